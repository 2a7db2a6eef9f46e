"""ModelRunner: loads the model on its device, owns the KV pool, and runs one forward per batch."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from radixserve.attention.base import (
    AttentionBackend,
    AttentionBackendUnavailable,
    AttentionCall,
    AttentionSpec,
    WindowCall,
)
from radixserve.attention.cpu_native import CpuNativeBackend
from radixserve.attention.registry import BackendChoice, choose_attention_backend
from radixserve.cache.kv_copy import HostDeviceCopier, KVCopy
from radixserve.cache.pools import KVCachePool
from radixserve.config.lora_args import LORA_TARGET_MODULES, lora_refs
from radixserve.config.server_args import InvalidArgumentError
from radixserve.distributed.parallel import (
    SINGLE,
    ParallelContext,
    broadcast_from_leader,
    min_over_ranks,
    stage_layers,
)
from radixserve.executor.base import ExecutorInfo, KVLayout, LoraAdapterInfo, MemoryReleasedError
from radixserve.executor.kv_sizing import kv_cache_dtype, kv_capacity, staging_tokens
from radixserve.executor.lora_pool import LoraPool
from radixserve.executor.model_loading import WeightLayout, load_model
from radixserve.executor.runner_config import RunnerConfig
from radixserve.executor.weight_formats import keeps_quantized, quantized_kernel_name, weight_bytes
from radixserve.forward.batch import ForwardBatch, window_view
from radixserve.kernels.cpu_ops import CpuKernels, select_cpu_kernels
from radixserve.kernels.native import NativeKernelsUnavailable
from radixserve.layers.linear import (
    FP32_NATIVE_MAX_ROWS,
    ParallelLinear,
    ParallelLMHead,
    quantized_storage,
    split_kv_heads,
)
from radixserve.layers.packed_weights import PackedWeight, WeightPacking, cpu_packing_supported
from radixserve.layers.sampler import SamplingBatch, sample
from radixserve.models.bert import Encoder
from radixserve.models.config import ModelConfig, ModelLoadError
from radixserve.models.llama import CausalLM
from radixserve.models.loader import model_name
from radixserve.models.lora_adapter import LoraAdapter, LoraAdapterError, read_adapter_config
from radixserve.models.moe import SparseMoE, expert_counts, record_experts
from radixserve.models.pooling import PoolingConfig, finish_embeddings, pool_segments, read_pooling_config
from radixserve.models.source import (
    ModelSource,
    load_model_config,
    resolve_model_source,
)
from radixserve.models.weight_updates import WeightStash, read_weight, update_weights

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError("--device cuda was asked for, but this torch build sees no CUDA device")
    return device


def cpu_has_fast_bf16() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    # bf16 matmul is faster than fp32 on CPUs with native bf16; elsewhere it is emulated and slow.
    # fp16 is never chosen on a CPU: it has no fast path there.
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def _lora_info(adapter: LoraAdapter) -> LoraAdapterInfo:
    return LoraAdapterInfo(adapter.name, adapter.path, adapter.rank, adapter.fingerprint)


class ModelRunner:
    """The executor (executor/base.py) that runs a real model. With tensor parallelism, one runner
    per rank holds that rank's shard (`parallel`)."""

    def __init__(
        self, config: RunnerConfig, source: ModelSource | None = None, parallel: ParallelContext = SINGLE
    ):
        self.runner_config = config
        self.parallel = parallel
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        self.source = source or resolve_model_source(config.model_path)
        self._released: set[str] = set()
        self._stash: WeightStash | None = None
        self.config: ModelConfig = load_model_config(self.source)
        self.context_len = self._context_len(self.config, config)
        self.config = _without_idle_window(self.config, self.context_len)
        # An embedding model answers embedding requests only (like SGLang's --is-embedding).
        self.is_embedding = config.is_embedding or self.config.is_encoder
        if self.config.is_encoder and parallel.world_size > 1:
            raise InvalidArgumentError("encoder (BERT) models run with --tp-size 1 and --pp-size 1 only")
        # The layers (and so the K/V) this rank's pipeline stage holds.
        self.num_local_layers = len(stage_layers(self.config.num_hidden_layers, parallel))
        self.local_kv_heads = split_kv_heads(self.config.num_key_value_heads, 1, parallel).local
        self.kernels = self._select_kernels()
        # Whether weights load quantized (a GGUF's blocks, or --quantization on safetensors), and
        # the resident bytes of those by format once loaded.
        self.quantized_weights = keeps_quantized(
            config.quantization, self.source, self.config, self.kernels, self.device
        )
        self.quantized_bytes: dict[str, int] = {}
        if self.quantized_weights and config.dtype == "auto":
            # The quantized kernel reads the same bytes whatever the activations' dtype, and fp32
            # activations keep its result that of the dequantized weights (docs/architecture.md).
            self.dtype = torch.float32
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.quantized_weights, self.device)
        # bf16 linear weights on a CPU are held packed for a matmul kernel (layers/packed_weights.py).
        packed = cpu_packing_supported(self.dtype, self.device, self.kernels)
        self.packing = WeightPacking(self.kernels) if packed else None
        self.pooling: PoolingConfig | None = None
        if self.is_embedding:
            model_dir = self.source.path if self.source.kind == "hf_dir" else None
            self.pooling = read_pooling_config(model_dir, self.config)
        torch.manual_seed(config.random_seed)
        # Chosen before the KV cache is sized: a backend that gathers K/V may keep copies (staging).
        spec = self._attention_spec(staging_tokens=0)
        choice = None
        if not self.config.is_encoder:
            try:
                choice = choose_attention_backend(config.attention_backend, spec)
            except AttentionBackendUnavailable as error:
                message = f"--attention-backend {config.attention_backend}: {error}"
                raise InvalidArgumentError(message) from error

        started = time.perf_counter()
        self.model = self._load_model()
        logger.info(
            "loaded %s (%s) in %.1fs: dtype=%s kv_cache_dtype=%s device=%s",
            self.config.architecture,
            self.source.path,
            time.perf_counter() - started,
            self.dtype,
            self.kv_dtype,
            self.device,
        )
        # --enable-lora: the adapters and their slots, on the layers this rank holds.
        self.lora = self._build_lora_pool()
        # Ranks see different free memory; their schedulers must count the same slots.
        gathers_kv = choice is not None and choice.backend.gathers_kv
        capacity = kv_capacity(config, self._kv_bytes_per_slot(), self.context_len, self.device, gathers_kv)
        (self.max_total_tokens,) = min_over_ranks([capacity], parallel)
        # The sliding-window layers whose K/V lie in window slots (cache/swa_pool.py), if any.
        self.window_layers = self._window_layers(choice)
        self.kv_pool = KVCachePool(
            num_slots=self.max_total_tokens,
            # An encoder keeps no K/V between steps: its slots are only accounting.
            num_layers=0 if self.config.is_encoder else self.num_local_layers,
            num_kv_heads=self.local_kv_heads,
            head_dim=self.config.head_dim,
            dtype=self.kv_dtype,
            device=self.device,
            window_layers=self.window_layers,
        )
        # The hierarchical cache's copies between this pool and host memory.
        self.kv_copier = HostDeviceCopier(self.device)
        # An encoder attends densely within each text and keeps no K/V: no backend.
        self.attention: AttentionBackend | None = None
        self.attention_reason = "encoder: dense attention within each text, no KV cache"
        if choice is not None:
            gathers = choice.backend.gathers_kv
            staging = staging_tokens(config, self.max_total_tokens, self.device) if gathers else 0
            self.attention = choice.backend(self._attention_spec(staging))
            self.attention_reason = choice.reason
        self._choose_decode_path()
        if config.enable_deterministic_inference:
            self._check_batch_invariant()
        logger.info(
            "attention backend: %s (%s); decode path: %s; linear kernel: %s",
            "none" if self.attention is None else self.attention.name,
            self.attention_reason,
            self.decode_path,
            self.describe()["linear_kernel"],
        )

    def _attention_spec(self, staging_tokens: int) -> AttentionSpec:
        return AttentionSpec(
            num_layers=self.num_local_layers,
            num_heads=self.config.num_attention_heads // self.parallel.tp_size,
            num_kv_heads=self.local_kv_heads,
            head_dim=self.config.head_dim,
            dtype=self.kv_dtype,
            device=self.device,
            kernels=self.kernels,
            decode_staging_tokens=staging_tokens,
            batch_invariant=self.runner_config.enable_deterministic_inference,
            sliding_window=self.config.sliding_window,
        )

    def _check_batch_invariant(self) -> None:
        """--enable-deterministic-inference: refuses, with the reason, what would let a request's
        numbers depend on its batch (the attention backend has refused its own part already)."""
        problem = None
        if self.parallel.tp_size > 1:
            problem = "tensor parallelism: the all-reduce splits its sums by the batch's size"
        elif self.attention is None:
            problem = "encoder (embedding) models are not covered: their layers run on torch ops"
        elif any(isinstance(m, SparseMoE) and not m.row_invariant for m in self.model.modules()):
            problem = (
                "Mixture-of-Experts layers run on torch matmuls whose sums depend on the row count "
                "(it holds for fp32 with every expert, a shared one too, in GGUF blocks)"
            )
        else:
            linears = [m for m in self.model.modules() if isinstance(m, (ParallelLinear, ParallelLMHead))]
            plain = [m for m in linears if m.packed is None or not m.packed.row_invariant]
            if plain:
                problem = (
                    f"{len(plain)} of {len(linears)} linear layers run on a matmul whose summation order "
                    "depends on the row count (oneDNN or MKL); it needs bf16 on the native CPU kernels"
                )
        if problem is not None:
            raise InvalidArgumentError(f"--enable-deterministic-inference cannot hold here: {problem}")

    def _window_layers(self, choice: BackendChoice | None) -> frozenset[int]:
        """The layers whose K/V lie in window slots, released once out of every window: the
        sliding ones, where the flags allow it (ServerArgs.window_memory_refusal) and the pool is
        read in place on a CPU (cpu_native; other backends keep K/V between steps by slot, and on
        CUDA the pool is reserved whole at start, so releasing saves nothing there). Logged."""
        config = self.config
        if not config.sliding_layers or config.sliding_window is None:
            return frozenset()
        refusal = self.runner_config.window_memory_refusal
        if refusal is None and (choice is None or choice.backend is not CpuNativeBackend):
            refusal = "the attention backend is not cpu_native"
        if refusal is None and self.device.type != "cpu":
            refusal = "not on a CPU"
        layers = frozenset(config.sliding_layers)
        if refusal is not None:
            logger.info("sliding-window layers keep their K/V for the whole request: %s", refusal)
            return frozenset()
        logger.info(
            "%d sliding-window layers hold their K/V in window slots, released %d positions behind",
            len(layers),
            config.sliding_window,
        )
        return layers

    @property
    def window(self) -> int | None:
        """The window whose layers hold their K/V in window slots (None: none do)."""
        return self.config.sliding_window if self.window_layers else None

    def _choose_decode_path(self) -> None:
        """Whether decode steps run in the fused native loop: decided when the weights are (re)loaded,
        never per step."""
        fused = None
        if isinstance(self.model, CausalLM) and isinstance(self.attention, CpuNativeBackend):
            # The fused loop runs whole layers natively: it has no place for LoRA deltas.
            if (self.dtype == torch.bfloat16 or self.quantized_weights) and self.lora is None:
                fused = self.model.fused_decode_plan(self.kv_dtype)
            self.attention.fused_decode = fused is not None
            self.attention.fused_shared_prefix = fused is not None and fused.shared_prefix
        if isinstance(self.model, CausalLM):
            self.model.fused_decode = fused

    @property
    def decode_path(self) -> str:
        return "none (encoder)" if self.attention is None else self.attention.decode_path

    @property
    def info(self) -> ExecutorInfo:
        return ExecutorInfo(
            self.config,
            self.context_len,
            self.max_total_tokens,
            self.dtype,
            self.device,
            self.is_embedding,
            pipeline_stages=self.parallel.pp_size,
            window=self.window,
        )

    @property
    def released(self) -> set[str]:
        return self._released

    def record_experts(self, recording: bool) -> None:
        record_experts(self.model, recording)

    def expert_counts(self) -> dict[int, list[int]]:
        return expert_counts(self.model)

    def describe(self) -> dict[str, Any]:
        return {
            "attention_backend": "none" if self.attention is None else self.attention.name,
            "attention_backend_reason": self.attention_reason,
            "decode_path": self.decode_path,
            "cpu_kernels": "torch" if self.kernels is None else "native",
            # The instruction set the native kernels were built for (None: torch ops only).
            "cpu_kernels_isa": None if self.kernels is None else self.kernels.isa,
            # What linears run on: bf16 (amx, native_<isa>, onednn, F.linear), or fp32 (native_fp32 for
            # decode-sized row counts, else F.linear); quantized weights: quant_<mode>_<isa>.
            "linear_kernel": self._linear_kernel(),
            # Resident bytes of the weights by format (GGUF type names, else the dense dtype), and of
            # the KV pool at its capacity (its pages are taken as tokens are stored).
            "weight_bytes": weight_bytes(self.model, self.quantized_bytes),
            "kv_cache_bytes": self.kv_pool.num_slots * self._kv_bytes_per_slot(),
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
            # The sliding-window layers whose K/V lie in window slots (cache/swa_pool.py).
            "window_layers": len(self.window_layers),
        }

    def _kv_bytes_per_slot(self) -> int:
        return KVCachePool.bytes_per_slot(
            self.num_local_layers, self.local_kv_heads, self.config.head_dim, self.kv_dtype
        )

    def _linear_kernel(self) -> str:
        if self.quantized_weights and self.kernels is not None:
            return quantized_kernel_name(self.kernels)
        if self.packing is not None:
            return self.packing.kernel
        if self.native_fp32_linears:
            return f"native_fp32 (up to {FP32_NATIVE_MAX_ROWS} rows), F.linear"
        return "F.linear"

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {
            "decode_staging_tokens": 0,
            "decode_staging_appends": 0,
            "decode_staging_refills": 0,
        }
        if self.attention is not None:
            stats |= self.attention.stats()
        if self.kernels is not None:
            stats["kernel_fallbacks"] = dict(self.kernels.fallbacks)
        return stats

    def _select_kernels(self) -> CpuKernels | None:
        if self.config.is_encoder:
            return None
        try:
            config = self.runner_config
            return select_cpu_kernels(config.cpu_kernels, self.device, config.cpu_isa)
        except NativeKernelsUnavailable as error:
            if self.runner_config.cpu_isa != "auto":
                raise InvalidArgumentError(str(error)) from error  # the message names --cpu-isa
            raise InvalidArgumentError(f"--cpu-kernels native: {error}") from error

    @staticmethod
    def _context_len(config: ModelConfig, args: RunnerConfig) -> int:
        limit = config.max_position_embeddings
        if args.context_length is not None:
            if args.context_length > limit:
                raise InvalidArgumentError(
                    f"--context-length {args.context_length} exceeds the model's limit of {limit} tokens"
                )
            return args.context_length
        return limit

    def _load_model(self) -> CausalLM | Encoder:
        """Builds the model and loads the source's weights (model_loading.py); the vision tower and
        the quantized weights' sizes come with them."""
        layout = WeightLayout(
            dtype=self.dtype,
            device=self.device,
            kernels=self.kernels,
            quantized=self.quantized_weights,
            quantization=self.runner_config.quantization,
            packing=self.packing,
            native_fp32_linears=self.native_fp32_linears,
        )
        loaded = load_model(self.source, self.config, self.context_len, self.parallel, layout)
        self.vision, self.quantized_bytes = loaded.vision, loaded.quantized_bytes
        return loaded.model

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if self.vision is None:
            raise ValueError("this model takes no images")
        self._check_resident("encode_images")
        embeds: torch.Tensor = self.vision.encode(pixel_values.to(self.device))
        return embeds

    @property
    def native_fp32_linears(self) -> bool:
        """fp32 on a CPU with the native kernels: decode-sized linears run on csrc/fp32_linear.cpp."""
        return self.dtype == torch.float32 and self.kernels is not None and self.device.type == "cpu"

    def load_other_weights(self, model_path: str) -> str:
        """Replaces the weights with another checkpoint of the same architecture and shapes. The new
        model is built beside the old one, so a failure (bad path, other shapes) leaves the old one
        serving; the memory of both is needed for a moment."""
        source = resolve_model_source(model_path)
        config = _without_idle_window(load_model_config(source), self.context_len)
        fields = ("architecture", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                  "sliding_window")  # fmt: skip
        different = [f for f in fields if getattr(config, f) != getattr(self.config, f)]
        if different:
            raise ModelLoadError(f"{model_path} differs from the served model in {', '.join(different)}")
        previous_source, previous_config = self.source, self.config
        self.source, self.config = source, config
        try:
            self.model = self._load_model()
        except BaseException:
            self.source, self.config = previous_source, previous_config
            raise
        self._choose_decode_path()
        logger.info("weights updated from %s", source.path)
        return str(source.path)

    def weight_slice(self, name: str, truncate_size: int) -> list[float]:
        """The first truncate_size values of a weight, by its checkpoint name."""
        weight = read_weight(self.model, model_name(self.config, name))
        values: list[float] = weight.flatten()[:truncate_size].float().tolist()
        return values

    def update_weights_from_tensors(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Loads checkpoint-named tensors in place; all or nothing. Returns how many were used."""
        self._check_resident("weights")
        used = update_weights(self.model, named, self.packing)
        self._choose_decode_path()
        return used

    def release_memory(self, tags: set[str]) -> None:
        """Frees the weights (kept on host, or on disk for a CPU) and/or the KV cache's buffers."""
        if "kv_cache" in tags - self._released:
            self.kv_pool.release()
            if self.attention is not None:
                self.attention.release()
        if "weights" in tags - self._released:
            self._stash = WeightStash(self.model, self.device, self.packing)
            self._stash.release()
        self._released |= tags

    def resume_memory(self, tags: set[str]) -> None:
        if "weights" in tags & self._released and self._stash is not None:
            self._stash.resume()
            self._stash = None
            self._choose_decode_path()
        if "kv_cache" in tags & self._released:
            self.kv_pool.allocate()
        self._released -= tags

    def resident_bytes(self) -> dict[str, int]:
        """Bytes the weights and the KV cache hold now (zero for what is released)."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        tensors += [
            p.data for m in self.model.modules() if isinstance(p := getattr(m, "packed", None), PackedWeight)
        ]
        tensors += quantized_storage(self.model)
        kv = self.kv_pool.k_buffers + self.kv_pool.v_buffers
        return {
            "weights": sum(t.numel() * t.element_size() for t in tensors),
            "kv_cache": sum(t.numel() * t.element_size() for t in kv),
        }

    def close(self) -> None:
        if self._stash is not None:
            self._stash.discard()

    def _check_resident(self, what: str) -> None:
        if self.released:
            raise MemoryReleasedError(
                f"{what}: the {' and '.join(sorted(self.released))} memory is released; "
                "call /resume_memory_occupation first"
            )

    def _build_lora_pool(self) -> LoraPool | None:
        config = self.runner_config
        if not config.enable_lora:
            return None
        if not isinstance(self.model, CausalLM):
            raise InvalidArgumentError("--enable-lora serves decoder (Llama-family) models only")
        refs = lora_refs(config.lora_paths, InvalidArgumentError)
        try:
            found = [read_adapter_config(Path(ref.path)) for ref in refs]
        except LoraAdapterError as exc:
            raise InvalidArgumentError(f"--lora-paths: {exc}") from exc
        max_rank = config.max_lora_rank or max(rank for rank, _, _ in found)
        wanted = config.lora_target_modules or set().union(*(targets for _, _, targets in found))
        targets = [m for m in LORA_TARGET_MODULES if m in wanted]
        layers = {int(index): layer for index, layer in self.model.layers.items()}
        pool = LoraPool(layers, self.config, self.parallel, config.max_loras_per_batch, max_rank, targets,
                        self.dtype, self.device)  # fmt: skip
        for ref in refs:
            try:
                pool.load(ref.name, ref.path)
            except LoraAdapterError as exc:
                raise InvalidArgumentError(f"--lora-paths: {exc}") from exc
        logger.info("LoRA: %d slots of rank %d on %s; decode runs unfused (the deltas need each linear)",
                    config.max_loras_per_batch, max_rank, ", ".join(targets))  # fmt: skip
        return pool

    def lora_adapters(self) -> list[LoraAdapterInfo]:
        pool = self.lora
        return [] if pool is None else [_lora_info(a) for a in pool.adapters.values()]

    def load_lora(self, name: str, path: str) -> LoraAdapterInfo:
        if self.lora is None:
            raise LoraAdapterError("LoRA adapters need --enable-lora")
        return _lora_info(self.lora.load(name, path))

    def unload_lora(self, name: str) -> None:
        if self.lora is not None:
            self.lora.unload(name)

    def set_lora_slot(self, slot: int, name: str) -> None:
        assert self.lora is not None
        self.lora.set_slot(slot, name)

    def _attention_call(self, batch: ForwardBatch) -> AttentionCall:
        assert self.attention is not None, "an encoder has no attention backend"
        if self.lora is not None:
            # The LoRA layers of this forward read which rows take which adapter's delta.
            self.lora.set_rows(batch.lora_groups, batch.num_tokens)
        metadata = self.attention.plan(batch)
        window = None
        if batch.window_map is not None:
            assert isinstance(self.attention, CpuNativeBackend)
            view = window_view(batch)
            window = WindowCall(self.attention.plan_window(view), view.out_cache_loc)
        return AttentionCall(self.attention, metadata, self.kv_pool, batch.out_cache_loc, window)

    def forward(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 logits for the batch's sample rows, then its logprob rows; and the final
        (normed) hidden states they came from."""
        self._check_resident("forward")
        if isinstance(self.model, Encoder):
            raise TypeError("an encoder model only embeds; this is a bug in the caller")
        logits, hidden = self.model(batch, self._attention_call(batch))
        return logits, hidden

    def forward_pipeline(
        self, batches: Sequence[ForwardBatch | None]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One tick of --pp-size micro-batching: this rank's stage runs its micro-batch, and every
        rank gets the result of the one the last stage finished (CausalLM.pipeline_tick)."""
        self._check_resident("forward")
        assert isinstance(self.model, CausalLM) and len(batches) == self.parallel.pp_size
        batch = batches[self.parallel.pp_rank]
        mine = None if batch is None else (batch, self._attention_call(batch))
        return self.model.pipeline_tick(mine, batches[-1])

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._check_resident("move_kv")
        self.kv_pool.move(src.to(self.device), dst.to(self.device))

    def kv_layout(self) -> KVLayout:
        pool = self.kv_pool
        return KVLayout(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype)

    def read_kv(self, slots: torch.Tensor) -> torch.Tensor:
        return self.read_kv_async(slots).wait()

    def write_kv(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        self._check_resident("write_kv")
        self.kv_pool.write_slots(slots.to(self.device), kv.to(self.device))

    def read_kv_async(self, slots: torch.Tensor) -> KVCopy:
        self._check_resident("read_kv")
        return self.kv_copier.download(self.kv_pool.read_slots(slots.to(self.device)))

    def upload_kv(self, pages: list[torch.Tensor]) -> KVCopy:
        return self.kv_copier.upload(pages)

    def idle(self) -> None:
        """Nothing runs: gives back the memory the attention backend keeps between steps."""
        if self.attention is not None:
            self.attention.idle()

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        """One fp32 embedding per request that completes its prompt in this batch, in row order."""
        assert self.pooling is not None, "not an embedding model"
        self._check_resident("embed")
        if isinstance(self.model, Encoder):
            assert batch.extend is not None
            pooled = pool_segments(self.model(batch), batch.extend, self.pooling.mode)
        else:
            pooled = self.model.final_hidden(batch, self._attention_call(batch)).float()
        return finish_embeddings(pooled, self.pooling)

    def sample(self, logits: torch.Tensor, sampling: SamplingBatch) -> torch.Tensor:
        """With several ranks rank 0 samples and the others take its tokens: one broadcast of a few
        ids keeps the ranks in step, whatever the seeds and the random state."""
        if self.parallel.world_size == 1:
            return sample(logits, sampling, self.kernels)
        if self.parallel.is_leader:
            tokens = sample(logits, sampling, self.kernels)
        else:
            tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        return broadcast_from_leader(tokens, self.parallel)


def _without_idle_window(config: ModelConfig, context_len: int) -> ModelConfig:
    """A sliding window no shorter than the context masks nothing: such a model runs as full
    attention, and so on the native paths, which take no window."""
    if config.sliding_window is None or config.sliding_window < context_len:
        return config
    logger.info("sliding window %d >= context %d: full attention", config.sliding_window, context_len)
    return dataclasses.replace(config, sliding_window=None, sliding_layers=())
