"""Per-request Python lists to tensors, the way the host hot path builds them.

Every decode step turns a dozen per-request lists (token ids, slots, lengths, sampling parameters)
into tensors. torch.tensor converts a list element by element through its generic scalar path;
numpy's fromiter of a known length is 3-4x faster (256 int64 values: about 16 µs against 4.5 µs
on the 2-core Zen 4), which at 256 running requests is a tenth of the scheduler's own step time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_NUMPY_DTYPES: dict[torch.dtype, type[np.generic]] = {
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.float32: np.float32,
    torch.bool: np.bool_,
}


def list_tensor(
    values: Sequence[int] | Sequence[float] | Sequence[bool], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """What torch.tensor(values, dtype=dtype, device=device) returns, built through numpy.

    The values are Python numbers of dtype's kind (ints for an integer dtype); floats are rounded
    to float32 as torch.tensor rounds them. The tensor owns its memory (nothing else holds the
    array); on a device it is the usual copy from the host."""
    array = np.fromiter(values, dtype=_NUMPY_DTYPES[dtype], count=len(values))
    return torch.from_numpy(array).to(device)
