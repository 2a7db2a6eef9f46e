"""RunnerConfig: the part of ServerArgs that the model runner reads, fixed where the process starts.

Model and runner code take this instead of ServerArgs, so what they depend on is visible in one
place. It has no defaults of its own: it is always made from a ServerArgs (from_server_args), whose
fields are where every default is written.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from radixserve.config.server_args import ServerArgs


@dataclass(frozen=True)
class RunnerConfig:
    model_path: str | None
    dtype: str
    quantization: str | None
    kv_cache_dtype: str
    device: str
    context_length: int | None
    random_seed: int
    is_embedding: bool
    cpu_kernels: str
    cpu_isa: str
    attention_backend: str
    enable_deterministic_inference: bool
    max_total_tokens: int | None
    mem_fraction_static: float
    max_running_requests: int | None
    page_size: int
    # Why sliding-window layers cannot hold their K/V in window slots under the flags (ServerArgs's
    # property), None where they can.
    window_memory_refusal: str | None
    decode_staging_tokens: int | None
    # --enable-lora (config/lora_args.py, executor/lora_pool.py).
    enable_lora: bool
    lora_paths: list[str] | None
    max_loras_per_batch: int
    max_lora_rank: int | None
    lora_target_modules: list[str] | None

    @classmethod
    def from_server_args(cls, args: ServerArgs) -> RunnerConfig:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
