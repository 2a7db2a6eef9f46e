"""The VERIFY forward mode (the seam for speculative decoding): one forward of k tokens per request
gives, at every position, the logits that k greedy decode steps would see."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from radixserve.attention.cpu_native import CpuDecodeMetadata
from radixserve.config.server_args import ServerArgs
from radixserve.forward.draft_tree import DraftTree
from radixserve.protocol.messages import GenerateRequest
from radixserve.protocol.sampling_params import SamplingParams
from radixserve.scheduler.batch import build_verify_batch
from radixserve.scheduler.process import build_scheduler
from tests.conftest import native_kernels_or_skip
from tests.engine.oracle import GREEDY, GreedyOracle, random_prompts

K = 4


@pytest.mark.parametrize("backend", ["torch_native", "cpu_native"])
def test_a_verify_step_matches_the_greedy_continuation(
    backend: str, tiny_model_dir: Callable[[str], Path], oracle: Callable[[str], GreedyOracle]
) -> None:
    args = ServerArgs(
        model_path=str(tiny_model_dir("llama")), dtype="float32", max_total_tokens=512,
        attention_backend=backend, disable_overlap_schedule=True, log_level="warning",
    )  # fmt: skip
    if backend == "cpu_native":
        native_kernels_or_skip()
    scheduler = build_scheduler(args)
    prompts = random_prompts(2, [9, 23], seed=50)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(
            GenerateRequest(f"r{i}", prompt, SamplingParams.from_dict({**GREEDY, "max_new_tokens": 32}))
        )
    scheduler.step()  # both prompts prefilled; each has its first output token, not yet in the pool
    reqs = list(scheduler.queues.running)
    assert [len(r.output_ids) for r in reqs] == [1, 1]
    expected = [oracle("llama").continue_(p, K + 1) for p in prompts]
    # Propose the true continuation: every position must then predict the next true token.
    proposals = [tokens[1:K] for tokens in expected]
    trees = [DraftTree.chain(r.output_ids[-1], p) for r, p in zip(reqs, proposals, strict=True)]
    batch = build_verify_batch(reqs, trees, scheduler.kv)
    logits, _ = scheduler.executor.forward(batch)
    assert logits.shape[0] == K * len(reqs)
    for index, (prompt, tokens) in enumerate(zip(prompts, expected, strict=True)):
        rows = logits[index * K : (index + 1) * K]
        assert rows.argmax(-1).tolist() == tokens[1 : K + 1]
        with torch.no_grad():
            reference = oracle("llama").model(input_ids=torch.tensor([prompt + tokens[:K]])).logits[0, -K:]
        torch.testing.assert_close(rows, reference, atol=1e-4, rtol=1e-4)

    # No proposal is accepted here: the verify step's slots go back, and the requests finish normally.
    scheduler.allocator.free(batch.out_cache_loc)
    while not scheduler.is_idle:
        scheduler.step()
    scheduler.check_kv_invariant()


def _tree_with_a_wrong_branch(root: int, true: list[int], vocab: int) -> DraftTree:
    """root -> true[0] -> true[1] -> ..., plus a wrong first token with a child of its own, put
    between the true nodes so that the tree's rows are not in depth order per branch."""
    wrong = (true[0] + 1) % vocab
    tokens = [root, true[0], wrong, *true[1:], (wrong + 1) % vocab]
    parents = [-1, 0, 0, 1, *range(3, len(true) + 1), 2]
    return DraftTree(tokens, parents)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_a_bf16_verify_runs_in_the_fused_loop_and_agrees_with_the_per_layer_path(
    shape: str, tiny_model_dir: Callable[[str], Path], oracle: Callable[[str], GreedyOracle]
) -> None:
    """With the fused native decode loop, a verify step runs as decode rows (one per token,
    attention/cpu_native.py verify_decode_layout; a tree node's row holds its context and its
    ancestors); its logits agree with the per-layer path's (extend math for chains, the masked
    tree attention for trees) to bf16 accuracy and give the same greedy tokens."""
    native_kernels_or_skip()
    args = ServerArgs(
        model_path=str(tiny_model_dir("llama")), dtype="bfloat16", max_total_tokens=512,
        attention_backend="cpu_native", disable_overlap_schedule=True, log_level="warning",
    )  # fmt: skip
    scheduler = build_scheduler(args)
    runner = scheduler.executor
    backend = runner.attention  # type: ignore[attr-defined]
    if not backend.fused_decode:
        pytest.skip("no fused decode loop on this machine's kernels")
    prompts = random_prompts(3, [9, 23, 14], seed=51)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(
            GenerateRequest(f"r{i}", prompt, SamplingParams.from_dict({**GREEDY, "max_new_tokens": 32}))
        )
    scheduler.step()
    reqs = list(scheduler.queues.running)
    expected = [oracle("llama").continue_(p, K + 1) for p in prompts]
    vocab = scheduler.config.vocab_size
    trees = [
        DraftTree.chain(r.output_ids[-1], tokens[1:K])
        if shape == "chain"
        else _tree_with_a_wrong_branch(r.output_ids[-1], tokens[1:K], vocab)
        for r, tokens in zip(reqs, expected, strict=True)
    ]
    batch = build_verify_batch(reqs, trees, scheduler.kv)
    assert (batch.verify_masks is None) == (shape == "chain")
    assert isinstance(backend.plan(batch), CpuDecodeMetadata)
    fused, _ = runner.forward(batch)
    backend.fused_decode = False
    try:
        per_layer, _ = runner.forward(batch)
    finally:
        backend.fused_decode = True
    assert (fused - per_layer).abs().mean() < 0.05
    assert torch.equal(fused.argmax(-1), per_layer.argmax(-1))
    scheduler.allocator.free(batch.out_cache_loc)
    while not scheduler.is_idle:
        scheduler.step()
    scheduler.check_kv_invariant()
