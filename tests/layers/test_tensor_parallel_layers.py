"""Sharding for tensor parallelism, checked in one process: what each rank loads and holds.

The collectives themselves run in tests/engine/test_tensor_parallel.py (two gloo ranks)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from radixserve.config.server_args import InvalidArgumentError, ServerArgs
from radixserve.distributed.parallel import ParallelContext
from radixserve.layers.linear import ColumnParallelLinear, ShardingError, split_kv_heads
from radixserve.models.config import ModelConfig
from radixserve.models.llama import CausalLM
from radixserve.models.loader import iter_weights
from radixserve.models.source import ModelSource, load_model_config


def _load(model_dir: Path, ctx: ParallelContext) -> tuple[CausalLM, ModelConfig]:
    source = ModelSource("hf_dir", model_dir)
    config = load_model_config(source)
    model = CausalLM(config, 64, ctx)
    model.load_weights(iter_weights(source, config))
    return model, config


def _count(model: CausalLM) -> int:
    # A tied lm_head shares the embedding's tensor: count each tensor once.
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_each_of_two_ranks_holds_half_the_weights(arch: str, tiny_model_dir: Callable[[str], Path]) -> None:
    full, config = _load(tiny_model_dir(arch), ParallelContext())
    ranks = [_load(tiny_model_dir(arch), ParallelContext(rank, 2))[0] for rank in range(2)]
    replicated = sum(p.numel() for name, p in full.named_parameters() if "norm" in name)
    for model in ranks:
        # Everything but the norms is split in two (the vocabulary rounded up on rank 0).
        assert _count(model) - replicated == pytest.approx(
            (_count(full) - replicated) / 2, abs=config.hidden_size
        )
    # The two shards put back together are the whole weight.
    for name, whole in full.named_parameters():
        parts = [dict(model.named_parameters())[name] for model in ranks]
        if "norm" in name:
            assert all(torch.equal(p, whole) for p in parts)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, dim=1), whole), name
        elif "qkv_proj" in name:
            shards = full.layers["0"].self_attn.qkv_proj.shards
            q, k, v = [sum(s.local for s in shards[:i]) for i in (1, 2, 3)]
            halves = [p.split([q // 2, (k - q) // 2, (v - k) // 2]) for p in parts]
            pieces = [torch.cat([h[i] for h in halves]) for i in range(3)]
            assert torch.equal(torch.cat(pieces), whole), name
        elif "gate_up" in name:
            gates, ups = zip(*(p.chunk(2) for p in parts), strict=True)
            assert torch.equal(torch.cat([*gates, *ups]), whole), name
        else:
            assert torch.equal(torch.cat(parts), whole), name


def test_kv_heads_are_copied_when_ranks_outnumber_them() -> None:
    head_dim, kv_heads, tp = 4, 2, 4
    full = torch.arange(kv_heads * head_dim * 3, dtype=torch.float32).reshape(-1, 3)
    for rank in range(tp):
        ctx = ParallelContext(rank, tp)
        shard = split_kv_heads(kv_heads, head_dim, ctx)
        layer = ColumnParallelLinear(3, [shard], bias=False, ctx=ctx)
        layer.load("weight", full, 0)
        # Ranks 0-1 attend with KV head 0, ranks 2-3 with KV head 1 (their query heads' group).
        head = rank * kv_heads // tp
        assert torch.equal(layer.weight, full[head * head_dim : (head + 1) * head_dim])
    with pytest.raises(ShardingError, match="multiple of num_key_value_heads"):
        split_kv_heads(3, head_dim, ParallelContext(0, 4))


def test_heads_that_do_not_split_are_refused(tiny_model_dir: Callable[[str], Path]) -> None:
    config = load_model_config(ModelSource("hf_dir", tiny_model_dir("llama")))
    with pytest.raises(ShardingError, match=r"num_attention_heads \(4\) is not divisible by --tp-size \(3\)"):
        CausalLM(config, 64, ParallelContext(0, 3))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp_size": 0}, "--tp-size must be >= 1"),
        (
            {"nnodes": 2, "node_rank": 2, "dist_init_addr": "127.0.0.1:5000", "tp_size": 2},
            "--node-rank must be in 0..1",
        ),
        ({"nnodes": 2, "tp_size": 2}, "needs --dist-init-addr"),
        ({"nnodes": 2, "tp_size": 3, "dist_init_addr": "10.0.0.1:5000"}, "multiple of --nnodes"),
        ({"nnodes": 2, "tp_size": 2, "dp_size": 2, "dist_init_addr": "10.0.0.1:5000"}, "--dp-size 1 only"),
        ({"dist_init_addr": "10.0.0.1"}, "must be HOST:PORT"),
        ({"dist_init_addr": "10.0.0.1:99999"}, "must be HOST:PORT"),
    ],
)
def test_parallel_arguments_are_validated(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        ServerArgs(**kwargs)  # type: ignore[arg-type]
