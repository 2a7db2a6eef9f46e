"""Mixture of Experts (models/moe.py) served end to end: expert-distribution recording (SGLang's
routes) against the routing transformers computes on the same tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from radixserve.runtime.engine import Engine
from tests.engine.oracle import random_prompts

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


def test_expert_counts_are_transformers_routing_of_the_tokens_run(
    tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Engine]
) -> None:
    """Every token a forward ran (each prompt and each output but the last, never fed back) counts
    once for each of the top-2 experts its router picks, in each sparse layer; tokens before the
    start and after the stop do not."""
    path = tiny_model_dir("qwen3_moe")
    engine = make_engine(path)
    engine.generate(input_ids=random_prompts(1, seed=3)[0], sampling_params=GREEDY)  # not recorded
    engine.start_expert_distribution_record()
    prompts = random_prompts(3, seed=4)
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    engine.stop_expert_distribution_record()
    engine.generate(input_ids=random_prompts(1, seed=5)[0], sampling_params=GREEDY)  # not recorded
    counts = engine.dump_expert_distribution_record()
    assert isinstance(outputs, list)

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = model.config
    expected = {layer: torch.zeros(config.num_local_experts, dtype=torch.int64) for layer in counts}
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens = prompt + out["output_ids"][:-1]
        with torch.no_grad():
            logits = model(torch.tensor([tokens]), output_router_logits=True).router_logits
        for layer, router in zip(sorted(counts), logits, strict=True):
            chosen = router.float().softmax(-1).topk(config.num_experts_per_tok, dim=-1).indices
            expected[layer] += torch.bincount(chosen.flatten(), minlength=config.num_local_experts)
    assert list(counts) == [1]  # layer 0 is dense (mlp_only_layers)
    for layer, tally in counts.items():
        assert tally == expected[layer].tolist(), layer
        assert sum(tally) == 2 * sum(len(p) + GREEDY["max_new_tokens"] - 1 for p in prompts)


def test_a_dense_model_has_nothing_to_record(
    tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(tiny_model_dir("llama"))
    result = engine.control("start_expert_distribution_record")
    assert not result.ok and "no Mixture-of-Experts layers" in (result.error or "")
