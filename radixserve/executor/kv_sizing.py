"""The KV pool's element type and size: chosen once at startup from the flags, the model and the
memory free, and logged.

dtype (--kv-cache-dtype): auto is the model's dtype, except fp32 activations over GGUF-quantized
weights on a CPU, which keep K/V in bf16 (llama.cpp keeps f16 K/V beside its f32 activations): half
the pool's bytes, and half of what a decode step reads of it, for an error that is bf16's rounding
of q, k and v in attention alone (docs/architecture.md gives the measured cost).

size: --max-total-tokens, else what --mem-fraction-static of the free memory holds, capped at every
running request at full context, and on a CPU at max(context, CPU_MIN_KV_TOKENS).
"""

from __future__ import annotations

import logging
import os

import torch

from radixserve.config.server_args import InvalidArgumentError
from radixserve.executor.runner_config import RunnerConfig

logger = logging.getLogger(__name__)

KV_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32}
# On a CPU without --max-total-tokens, the KV pool holds the context (--context-length, else the
# model's) and never fewer tokens than this, so that a batch of ordinary requests shares it; within
# the free memory. Its pages are taken as tokens are stored (cache/pools.py, zeros_on_demand).
CPU_MIN_KV_TOKENS = 16384
# Default cap on decode staging (attention/staging.py) on a CPU, in K/V tokens.
CPU_DEFAULT_STAGING_TOKENS = 32768


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    pages = os.sysconf("SC_AVPHYS_PAGES")
    return int(pages * os.sysconf("SC_PAGE_SIZE"))


def kv_cache_dtype(
    asked: str, dtype: torch.dtype, quantized_weights: bool, device: torch.device
) -> torch.dtype:
    """--kv-cache-dtype: the pool's element type (the rule: this module's docstring)."""
    if asked != "auto":
        return KV_CACHE_DTYPES[asked]
    if dtype == torch.float32 and quantized_weights and device.type == "cpu":
        return torch.bfloat16
    return dtype


def kv_capacity(
    args: RunnerConfig, per_slot: int, context_len: int, device: torch.device, gathers_kv: bool
) -> int:
    """The pool's slots (tokens), a whole number of pages; per_slot: bytes a token's K/V take."""
    page = args.page_size
    if args.max_total_tokens is not None:
        tokens = args.max_total_tokens
    else:
        budget = free_memory_bytes(device) * args.mem_fraction_static
        tokens = int(budget // per_slot)
        if gathers_kv and args.decode_staging_tokens is None and device.type == "cpu":
            # The default decode staging lives in the same budget.
            tokens -= min(tokens // 2, CPU_DEFAULT_STAGING_TOKENS)
        # More slots than every running request at full context can never be used.
        max_running = args.max_running_requests or 256
        tokens = min(tokens, max_running * context_len)
        if device.type == "cpu":
            # Host memory is shared with everything else on the machine, and a CPU serves far
            # fewer concurrent tokens than a GPU: room for the context, not for all of memory.
            wanted = max(context_len, CPU_MIN_KV_TOKENS)
            logger.info(
                "KV cache sized for max(context %d, %d) tokens, within %.1f GiB free x %.2f",
                context_len, CPU_MIN_KV_TOKENS, budget / args.mem_fraction_static / 2**30,
                args.mem_fraction_static,
            )  # fmt: skip
            tokens = min(tokens, wanted)
    tokens = tokens // page * page
    if tokens < page:
        raise InvalidArgumentError(
            f"no memory left for the KV cache ({per_slot} bytes per token); "
            "lower the model size or raise --mem-fraction-static"
        )
    logger.info("KV cache: %d tokens, %.1f MiB", tokens, tokens * per_slot / 2**20)
    return tokens


def staging_tokens(args: RunnerConfig, max_total_tokens: int, device: torch.device) -> int:
    """Decode staging's budget for a backend that gathers K/V: --decode-staging-tokens, else
    by default on a CPU the KV cache up to CPU_DEFAULT_STAGING_TOKENS. On CUDA the gather it
    saves is cheap next to the memory it would take from the pool."""
    if args.decode_staging_tokens is not None:
        return args.decode_staging_tokens
    return min(max_total_tokens, CPU_DEFAULT_STAGING_TOKENS) if device.type == "cpu" else 0
