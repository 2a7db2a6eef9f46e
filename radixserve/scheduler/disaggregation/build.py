"""The scheduler's half of prefill/decode disaggregation, built from the flags."""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.config.server_args import ServerArgs
from radixserve.distributed.kv_transfer import GlooDecodeTransfer, GlooPrefillTransfer, layout_signature
from radixserve.executor.base import Executor, KVSlots, MissingCapabilityError
from radixserve.scheduler.batch import KVContext
from radixserve.scheduler.disaggregation.decode import DecodeHandoffs
from radixserve.scheduler.disaggregation.prefill import PrefillHandoffs


def build_handoffs(
    args: ServerArgs,
    executor: Executor,
    kv: KVContext,
    written: Callable[[torch.Tensor], None] | None,
) -> tuple[PrefillHandoffs | None, DecodeHandoffs | None]:
    """(prefill side, None), (None, decode side), or (None, None) without --disaggregation-mode."""
    if args.disaggregation_mode == "null":
        return None, None
    if not isinstance(executor, KVSlots):
        raise MissingCapabilityError(executor, KVSlots, "--disaggregation-mode")
    layout = executor.kv_layout()
    signature = layout_signature((layout.num_layers, 2, layout.num_kv_heads, layout.head_dim), layout.dtype)
    if args.disaggregation_mode == "prefill":
        transfer = GlooPrefillTransfer(
            args.host, args.disaggregation_bootstrap_port, signature, args.disaggregation_timeout
        )
        return PrefillHandoffs(transfer, executor, kv.req_to_token_pool), None
    decode_transfer = GlooDecodeTransfer(args.host, signature)
    return None, DecodeHandoffs(decode_transfer, kv, executor, args.disaggregation_timeout, written)
