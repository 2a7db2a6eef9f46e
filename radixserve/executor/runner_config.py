"""RunnerConfig: the part of ServerArgs that the model runner reads, fixed where the process starts.

Model and runner code take this instead of ServerArgs, so what they depend on is visible in one
place (and a test or a simulator can build one without the server's other knobs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from radixserve.config.server_args import ServerArgs


@dataclass(frozen=True)
class RunnerConfig:
    model_path: str | None = None
    dtype: str = "auto"
    quantization: str | None = None
    device: str = "auto"
    context_length: int | None = None
    random_seed: int = 0
    is_embedding: bool = False
    cpu_kernels: str = "auto"
    cpu_isa: str = "auto"
    attention_backend: str = "auto"
    enable_deterministic_inference: bool = False
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.85
    max_running_requests: int | None = None
    page_size: int = 1
    decode_staging_tokens: int | None = None
    # --enable-lora (config/lora_args.py, executor/lora_pool.py).
    enable_lora: bool = False
    lora_paths: list[str] | None = None
    max_loras_per_batch: int = 8
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None

    @classmethod
    def from_server_args(cls, args: ServerArgs) -> RunnerConfig:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
