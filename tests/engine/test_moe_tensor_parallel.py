"""Mixture of Experts under --tp-size 2 (models/moe.py): every rank holds every expert, cut along
its intermediate dimension, and one all-reduce a layer sums the ranks' shares. Greedy fp32 tokens
equal transformers' (and so one rank's) for the four MoE families, batched and from the radix
cache (OLMoE's q/k norms over the whole projection too), and the expert counts equal one rank's.
In one process: each rank's slices, and their outputs summed, are one rank's layer; OLMoE's
full-width q/k norms over four ranks (KV heads copied) are one rank's."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from radixserve.distributed.parallel import ParallelContext
from radixserve.layers.linear import ShardingError
from radixserve.models import llama, moe
from radixserve.models.config import ModelConfig
from radixserve.models.llama import Attention
from radixserve.models.loader import iter_weights
from radixserve.models.moe import SparseMoE
from radixserve.models.source import ModelSource, load_model_config
from radixserve.runtime.engine import Engine
from tests.engine.oracle import GREEDY, GreedyOracle, assert_results_match, random_prompts

MOE_ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]
MAX_NEW = 8


def _routing(oracle: GreedyOracle, sequences: list[list[int]], layers: list[int]) -> dict[int, list[int]]:
    """Per sparse layer, the tokens transformers routes to each expert over the sequences."""
    config = oracle.model.config
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    counts = {layer: torch.zeros(experts, dtype=torch.int64) for layer in layers}
    for tokens in sequences:
        with torch.no_grad():
            routers = oracle.model(torch.tensor([tokens]), output_router_logits=True).router_logits
        assert len(routers) == len(layers)
        for layer, router in zip(layers, routers, strict=True):
            chosen = router.float().softmax(-1).topk(config.num_experts_per_tok, dim=-1).indices
            counts[layer] += torch.bincount(chosen.flatten(), minlength=experts)
    return {layer: tally.tolist() for layer, tally in counts.items()}


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_two_ranks_give_transformers_tokens_and_counts(
    arch: str,
    tiny_model_dir: Callable[[str], Path],
    oracle: Callable[[str], GreedyOracle],
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(tiny_model_dir(arch), tp_size=2)
    # Recorded on every rank alike; the answer is rank 0's, the count of one rank's routing.
    engine.start_expert_distribution_record()
    prompts = random_prompts(4, seed=7)
    outputs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": MAX_NEW})
    engine.stop_expert_distribution_record()
    counts = engine.dump_expert_distribution_record()
    assert isinstance(outputs, list)
    assert_results_match(outputs, prompts, oracle(arch), MAX_NEW)
    run = [p + out["output_ids"][:-1] for p, out in zip(prompts, outputs, strict=True)]
    assert counts == _routing(oracle(arch), run, sorted(counts))

    # Prompts sharing a prefix, one after the other: the second's prefix comes from the cache.
    prefix = random_prompts(1, [40], seed=9)[0]
    for tail in random_prompts(2, seed=10):
        results = engine.generate(
            input_ids=[prefix + tail], sampling_params={**GREEDY, "max_new_tokens": MAX_NEW}
        )
        assert isinstance(results, list)
        (res,) = results
        assert res["output_ids"] == oracle(arch).continue_(prefix + tail, MAX_NEW)
    assert res["meta_info"]["cached_tokens"] >= len(prefix)

    # /get_weights_by_name gathers an expert's slices (and the router) into the checkpoint's tensor.
    checked = 0
    for path in tiny_model_dir(arch).glob("*.safetensors"):
        with safe_open(str(path), "pt") as stored:
            for name in stored.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if ".experts.1." in name or name.endswith(("mlp.gate.weight", "moe.gate.weight")):
                    got = engine.get_weights_by_name(name, truncate_size=10_000)
                    expected = stored.get_tensor(name).float().flatten()[: len(got)].tolist()
                    assert got == pytest.approx(expected, abs=1e-6), name
                    checked += 1
    assert checked >= 4  # a router and an expert's three projections at least


def test_two_ranks_count_what_one_rank_counts(
    tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Engine]
) -> None:
    """The same requests on one rank and on two (Qwen2-MoE: a shared expert, every layer sparse)."""
    path = tiny_model_dir("qwen2_moe")
    dumps = []
    for engine in (make_engine(path), make_engine(path, tp_size=2)):
        engine.start_expert_distribution_record()
        engine.generate(input_ids=random_prompts(3, seed=8), sampling_params={**GREEDY, "max_new_tokens": 6})
        engine.stop_expert_distribution_record()
        dumps.append(engine.dump_expert_distribution_record())
    assert dumps[0] == dumps[1]
    assert list(dumps[0]) == [0, 1] and all(sum(tally) > 0 for tally in dumps[0].values())


def _sparse_layer(path: Path, ctx: ParallelContext) -> tuple[SparseMoE, ModelConfig]:
    """Layer 1's SparseMoE of the checkpoint, as rank ctx.tp_rank loads it."""
    source = ModelSource("hf_dir", path)
    config = load_model_config(source)
    layer = SparseMoE(config, ctx, None)
    prefix = "model.layers.1.mlp."
    for name, tensor in iter_weights(source, config):
        if name.startswith(prefix):
            layer.load(name.removeprefix(prefix), tensor)
    return layer, config


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_each_rank_holds_its_slice_and_the_slices_sum_to_the_layer(
    arch: str, tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    whole, config = _sparse_layer(tiny_model_dir(arch), ParallelContext())
    ranks = [_sparse_layer(tiny_model_dir(arch), ParallelContext(rank, 2))[0] for rank in range(2)]
    for name, full in whole.named_parameters():
        parts: list[torch.Tensor] = [dict(r.named_parameters())[name] for r in ranks]
        if name in ("router", "shared_gate"):
            assert all(torch.equal(p, full) for p in parts), name
        elif "down" in name:
            assert torch.equal(torch.cat(parts, dim=-1), full), name
        else:  # each rank's gate slice, then its up slice
            gates, ups = zip(*(p.chunk(2, dim=-2) for p in parts), strict=True)
            assert torch.equal(torch.cat([*gates, *ups], dim=-2), full), name

    # Each rank's output is its slices' share; the all-reduce (here: the sum) makes the layer's.
    monkeypatch.setattr(moe, "all_reduce", lambda x, ctx: x)
    x = torch.randn(9, config.hidden_size)
    zero = torch.zeros_like(x)
    shares = sum(r(x, zero) for r in ranks)
    assert torch.allclose(shares, whole(x, zero), rtol=1e-5, atol=1e-5)


def test_intermediate_sizes_that_do_not_split_are_refused(tiny_model_dir: Callable[[str], Path]) -> None:
    config = load_model_config(ModelSource("hf_dir", tiny_model_dir("qwen2_moe")))
    assert (config.moe_intermediate_size, config.shared_expert_intermediate_size) == (32, 64)
    with pytest.raises(ShardingError, match=r"experts' intermediate size \(32\) .* --tp-size \(3\)"):
        SparseMoE(config, ParallelContext(0, 3), None)
    uneven = dataclasses.replace(config, shared_expert_intermediate_size=50)
    with pytest.raises(ShardingError, match=r"shared expert's intermediate size \(50\) .* --tp-size \(4\)"):
        SparseMoE(uneven, ParallelContext(0, 4), None)


def test_full_width_qk_norms_split_over_ranks_are_one_ranks(
    tiny_model_dir: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """OLMoE's q/k norms over 4 ranks, its 2 KV heads each held by two: every rank's columns come
    out as one rank's norms give them (the all-reduce here: threads summing their tensors)."""
    config = load_model_config(ModelSource("hf_dir", tiny_model_dir("olmoe")))
    tp = 4
    whole = Attention(config, 0, ParallelContext(), None)
    ranks = [Attention(config, 0, ParallelContext(rank, tp), None) for rank in range(tp)]
    for attention in [whole, *ranks]:
        for norm in (attention.q_norm, attention.k_norm):
            assert norm is not None
            torch.manual_seed(norm.weight.shape[0])
            norm.load("weight", 1 + 0.1 * torch.randn(norm.weight.shape))
    q_size, kv_size = whole.num_heads * config.head_dim, whole.num_kv_heads * config.head_dim
    q, k = 3 * torch.randn(5, q_size), torch.randn(5, kv_size)
    expected_q, expected_k = whole._full_width_norms(q, k)

    sums: list[torch.Tensor | None] = [None] * tp
    barrier = threading.Barrier(tp)

    def summed(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
        sums[ctx.tp_rank] = x.clone()
        barrier.wait()
        total = torch.stack([s for s in sums if s is not None]).sum(0)
        barrier.wait()
        return x.copy_(total)

    monkeypatch.setattr(llama, "all_reduce", summed)
    out: list[tuple[torch.Tensor, torch.Tensor]] = [(q, k)] * tp

    def run(rank: int) -> None:
        attention = ranks[rank]
        q_local, k_local = q_size // tp, attention.num_kv_heads * config.head_dim
        mine = q[:, rank * q_local : (rank + 1) * q_local], k[:, attention.k_start :][:, :k_local]
        out[rank] = attention._full_width_norms(*mine)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(tp)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert torch.allclose(torch.cat([o[0] for o in out], dim=1), expected_q, atol=1e-6)
    for rank, (_, k_rank) in enumerate(out):
        start = ranks[rank].k_start
        assert torch.allclose(k_rank, expected_k[:, start : start + k_rank.shape[1]], atol=1e-6)
    assert ranks[0].k_start == ranks[1].k_start == 0 and ranks[2].k_start == config.head_dim
