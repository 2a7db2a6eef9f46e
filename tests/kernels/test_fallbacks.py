"""A native op that declines its input is counted and logged, never silent."""

from __future__ import annotations

import logging

import pytest
import torch

from radixserve.kernels.cpu_ops import CpuKernels
from radixserve.kernels.native import load_library
from tests.conftest import native_kernels_or_skip


def test_declines_are_counted_per_op_and_logged_once_per_signature(caplog: pytest.LogCaptureFixture) -> None:
    native_kernels_or_skip()
    # A fresh instance (not the session fixture's): its counters start at zero.
    kernels = CpuKernels(load_library())
    weight = torch.ones(16)
    rows = torch.randn(4, 16)
    with caplog.at_level(logging.INFO, logger="radixserve.kernels"):
        assert kernels.rms_norm(rows, weight, 1e-6) is not None  # handled: not counted
        for _ in range(3):
            assert kernels.rms_norm(torch.randn(2, 4, 16), weight, 1e-6) is None  # 3-D: declined
        assert kernels.silu_and_mul(torch.randn(3, 7)) is None  # odd width: declined
    assert kernels.fallbacks == {"rms_norm": 3, "silu_and_mul": 1}
    logged = [r.getMessage() for r in caplog.records if "declined" in r.getMessage()]
    assert len(logged) == 2
    assert logged[0].startswith("native rms_norm declined [torch.float32 (2, 4, 16)")
