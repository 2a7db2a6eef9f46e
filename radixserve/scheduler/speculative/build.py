"""The speculator --speculative-algorithm asks for (None without one)."""

from __future__ import annotations

from collections.abc import Callable

from radixserve.config.server_args import ServerArgs
from radixserve.executor.base import DraftExecutor, Executor, MissingCapabilityError
from radixserve.scheduler.speculative.draft_model import DraftModelSpeculator
from radixserve.scheduler.speculative.worker import NgramSpeculator, Speculator


def build_speculator(
    args: ServerArgs,
    target: Executor,
    draft: Executor | None,
    row_len: int,
    agree: Callable[[list[int]], list[int]],
) -> Speculator | None:
    """row_len: a request-to-token row's length; agree: the ranks' agreement on sizes
    (scheduler/rank_sync.py). draft: STANDALONE's draft model, its KV pool as large as the target's."""
    info = target.info
    if info.is_embedding or args.speculative_algorithm is None:
        return None
    if args.speculative_algorithm == "NGRAM":
        return NgramSpeculator(args, info.context_len, row_len, agree)
    if draft is None:
        raise ValueError("--speculative-algorithm STANDALONE needs the draft model's executor")
    if not isinstance(draft, DraftExecutor):
        raise MissingCapabilityError(draft, DraftExecutor, "a STANDALONE draft model")
    if draft.info.max_total_tokens < info.max_total_tokens:
        raise ValueError("the draft model's KV pool must hold as many slots as the target's")
    return DraftModelSpeculator(args, info.context_len, row_len, draft, info.config.vocab_size, agree)
