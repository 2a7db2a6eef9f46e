"""--attention-backend: the registry of backends, and the one choice made at startup."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from radixserve.attention.base import AttentionBackend, AttentionBackendUnavailable, AttentionSpec
from radixserve.attention.cpu_native import CpuNativeBackend
from radixserve.attention.torch_native import TorchNativeBackend

logger = logging.getLogger(__name__)

# Extension point: a new backend registers here under its --attention-backend name (and
# config/server_args.py lists the name). A CUDA backend would also become auto's choice on CUDA.
ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchNativeBackend.name: TorchNativeBackend,
    CpuNativeBackend.name: CpuNativeBackend,
}
# Other names users know a backend by.
ALIASES = {"torch": TorchNativeBackend.name}


@dataclass(frozen=True)
class BackendChoice:
    backend: type[AttentionBackend]
    reason: str


def choose_attention_backend(choice: str, spec: AttentionSpec) -> BackendChoice:
    """The backend class for --attention-backend `choice`. 'auto' takes cpu_native on a CPU where
    it can run this model, else torch_native, and says why; a named backend that cannot run
    raises AttentionBackendUnavailable with the reason."""
    name = ALIASES.get(choice, choice)
    if name != "auto":
        if name not in ATTENTION_BACKENDS:
            known = ", ".join(["auto", *ATTENTION_BACKENDS, *ALIASES])
            raise AttentionBackendUnavailable(f"unknown attention backend {choice!r} (known: {known})")
        backend = ATTENTION_BACKENDS[name]
        backend.check_available(spec)
        return BackendChoice(backend, "asked for with --attention-backend")
    if spec.device.type != "cpu":
        TorchNativeBackend.check_available(spec)
        return BackendChoice(TorchNativeBackend, f"auto on {spec.device.type}: no other backend registered")
    try:
        CpuNativeBackend.check_available(spec)
    except AttentionBackendUnavailable as why:
        TorchNativeBackend.check_available(spec)  # refuses what only cpu_native does
        return BackendChoice(TorchNativeBackend, f"auto: cpu_native unavailable ({why})")
    return BackendChoice(CpuNativeBackend, "auto on a CPU with the native kernels")
