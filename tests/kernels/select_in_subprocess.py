"""Runs select_cpu_kernels in a fresh interpreter (the library is loaded once per process)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = (
    "import torch\n"
    "from radixserve.kernels.cpu_ops import select_cpu_kernels\n"
    "from radixserve.kernels.native import NativeKernelsUnavailable\n"
    "assert select_cpu_kernels('auto', torch.device('cpu')) is None\n"
    "try:\n"
    "    select_cpu_kernels('native', torch.device('cpu'))\n"
    "except NativeKernelsUnavailable as error:\n"
    "    print('REASON', error)\n"
)


def select_with(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """--cpu-kernels auto must fall back to torch ops under env; native must fail and print REASON."""
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done
