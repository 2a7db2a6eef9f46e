"""The executor interface: what the scheduler needs from whatever runs the model.

The scheduler decides *what* runs (which requests, which tokens, which KV slots); an executor runs
it. `ModelRunner` runs a real model. Tests drive the scheduler with a fake executor
(tests/scheduler/fake_executor.py); the same seam is where a cost-model executor (a scheduler
simulator) and a speculative-decoding worker plug in. `Executor` is what every one of them does;
each feature that needs more (K/V by slot, LoRA slots, memory and weight control, ...) asks for its
capability Protocol when the scheduler is built, and an executor without it is refused there with
MissingCapabilityError.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from radixserve.cache.storage_tier import KVAccess
from radixserve.forward.batch import ForwardBatch
from radixserve.layers.sampler import SamplingBatch
from radixserve.models.config import ModelConfig

# What /release_memory_occupation can release (SGLang's tags).
MEMORY_TAGS = ("weights", "kv_cache")


class MemoryReleasedError(RuntimeError):
    """The weights or the KV cache are released; /resume_memory_occupation brings them back."""


@dataclass(frozen=True)
class ExecutorInfo:
    """What the scheduler sizes itself by, fixed once the model is loaded."""

    config: ModelConfig
    context_len: int
    max_total_tokens: int  # KV slots the executor's pool holds
    dtype: torch.dtype
    device: torch.device
    # The model answers embedding requests only (an encoder, or a decoder under --is-embedding).
    is_embedding: bool
    # --pp-size: the scheduler keeps this many micro-batches in flight (forward_pipeline).
    pipeline_stages: int = 1
    # The window of the sliding layers whose K/V lie in window slots (cache/swa_pool.py): the
    # scheduler then allocates them (WindowSlotAllocator). None: every layer reads by its slots.
    window: int | None = None


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


@dataclass(frozen=True)
class LoraAdapterInfo:
    """An adapter the executor loaded (--enable-lora): fingerprint is its weights file's SHA-256."""

    name: str
    path: str
    rank: int
    fingerprint: str


class Executor(Protocol):
    """What every executor does: run the scheduler's batches. What only some do (pipelines,
    embeddings, images, K/V access, LoRA slots, memory and weight control) is a capability below,
    which the scheduler asks for by `capability()` where a feature needs it."""

    @property
    def info(self) -> ExecutorInfo: ...

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 logits for the batch's sample rows, then its logprob rows; and the final
        (normed) hidden states they came from, then those of its hidden rows."""
        ...

    def sample(self, logits: torch.Tensor, sampling: SamplingBatch) -> torch.Tensor:
        """One token id per row of logits."""
        ...

    def idle(self) -> None:
        """Nothing runs now: a chance to give back scratch memory."""
        ...

    def close(self) -> None: ...

    def describe(self) -> dict[str, Any]:
        """The choices made at startup (attention backend, decode path, CPU ISA), for
        /get_server_info."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters that change as it runs (decode staging, kernel fallbacks), for /get_server_info."""
        ...


@runtime_checkable
class PipelineStages(Protocol):
    """--pp-size > 1."""

    def forward_pipeline(
        self, batches: Sequence[ForwardBatch | None]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One tick of a pipeline of info.pipeline_stages stages: stage s runs batches[s] (the
        micro-batch launched s ticks ago; None for none). Returns forward()'s result for
        batches[-1], which the last stage finished this tick (None when it is None)."""
        ...


@runtime_checkable
class Embeddings(Protocol):
    """An embedding model (info.is_embedding)."""

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        """One fp32 embedding per request that completes its prompt in this batch, in row order."""
        ...


@runtime_checkable
class ImageEncoding(Protocol):
    """A vision-language model."""

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """A vision-language model's image embeddings: [n, channels, height, width] float32 pixel
        values to [n, tokens_per_image, hidden_size] vectors in the model's dtype, which take the
        place of each image's tokens in the prompt."""
        ...


@runtime_checkable
class KVSlots(KVAccess, Protocol):
    """The K/V in the executor's pool by slot: the cache tiers below the pool read and write them
    (KVAccess, cache/storage_tier.py), speculative decoding moves them, prefill/decode
    disaggregation sends and installs them."""

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copies the K/V of slots src to slots dst in every layer (speculative decoding moves an
        accepted draft path's K/V to the positions it ends up at)."""
        ...

    def kv_layout(self) -> KVLayout:
        """The shape of one slot's K/V in every layer (what a lower cache tier stores per token)."""
        ...


@runtime_checkable
class LoraSlots(Protocol):
    """--enable-lora (executor/lora_pool.py)."""

    def lora_adapters(self) -> list[LoraAdapterInfo]:
        """The adapters loaded (those of --lora-paths at first)."""
        ...

    def load_lora(self, name: str, path: str) -> LoraAdapterInfo:
        """Reads and checks a PEFT adapter into host memory; LoraAdapterError says why not."""
        ...

    def unload_lora(self, name: str) -> None: ...

    def set_lora_slot(self, slot: int, name: str) -> None:
        """Copies a loaded adapter into one of the --max-loras-per-batch slots batches read."""
        ...


@runtime_checkable
class MemoryControl(Protocol):
    """/release_memory_occupation and /resume_memory_occupation (MEMORY_TAGS)."""

    @property
    def released(self) -> set[str]:
        """The memory tags now released; empty while everything is resident."""
        ...

    def release_memory(self, tags: set[str]) -> None: ...

    def resume_memory(self, tags: set[str]) -> None: ...

    def resident_bytes(self) -> dict[str, int]: ...


@runtime_checkable
class WeightControl(Protocol):
    """Reading and replacing the weights while serving (/get_weights_by_name, /update_weights_*)."""

    def weight_slice(self, name: str, truncate_size: int) -> list[float]: ...

    def load_other_weights(self, model_path: str) -> str:
        """Replaces the weights with another checkpoint of the same shapes; returns its path."""
        ...

    def update_weights_from_tensors(self, named: list[tuple[str, torch.Tensor]]) -> int: ...


@runtime_checkable
class ExpertRecording(Protocol):
    """/start_expert_distribution_record and its stop and dump (a Mixture-of-Experts model)."""

    def record_experts(self, recording: bool) -> None:
        """Starts counting, from zero, the tokens each layer routes to each expert (True), or
        stops counting and keeps the counts (False)."""
        ...

    def expert_counts(self) -> dict[int, list[int]]:
        """Per sparse layer (its index in the model), the tokens routed to each expert so far."""
        ...


@runtime_checkable
class DraftExecutor(Executor, MemoryControl, Protocol):
    """A STANDALONE draft model (--speculative-draft-model-path): it runs forwards, and its memory
    is released and resumed with the target's."""


class MissingCapabilityError(ValueError):
    """A feature asked of an executor that does not offer it (the message names both)."""

    def __init__(self, executor: object, capability: type, wanted_by: str):
        name = type(executor).__name__
        super().__init__(f"{wanted_by} needs an executor with {capability.__name__}, which {name} lacks")
