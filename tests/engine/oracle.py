"""Test helpers: deterministic prompts and a transformers greedy oracle."""

from __future__ import annotations

import queue
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from radixserve.protocol.messages import FinishReason, GenerateRequest, ReqOutput
from radixserve.runtime.engine import Engine
from radixserve.scheduler.scheduler import Scheduler


def random_prompts(
    n: int, lengths: list[int] | None = None, seed: int = 0, vocab: int = 500
) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = lengths or [rng.randrange(3, 60) for _ in range(n)]
    # Ids 0-2 are the special tokens of the fixture tokenizer; keep prompts to ordinary tokens.
    return [[rng.randrange(3, vocab) for _ in range(length)] for length in lengths]


class GreedyOracle:
    """Greedy continuation with transformers on the same weights, in fp32, one prompt at a time."""

    def __init__(
        self,
        model_dir: Path,
        lora_dir: Path | None = None,
        gguf_file: str | None = None,
        last_logits_only: bool = False,
    ):
        """lora_dir: a PEFT adapter applied on top (peft's own LoRA layers, unmerged); gguf_file: a
        GGUF file in model_dir to load (transformers dequantizes it); last_logits_only: the LM head
        over a prompt's last position only (a large vocabulary's head over every position of a
        long prompt costs seconds)."""
        from transformers import AutoModelForCausalLM

        kwargs: dict[str, Any] = {} if gguf_file is None else {"gguf_file": gguf_file}
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).eval()
        self._keep: dict[str, Any] = {"logits_to_keep": 1} if last_logits_only else {}
        if lora_dir is not None:
            from peft import PeftModel

            self.model = PeftModel.from_pretrained(self.model, lora_dir).eval()
        self._memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    @torch.no_grad()
    def continue_(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in self._memo:
            out = self.model(input_ids=torch.tensor([prompt]), use_cache=True, **self._keep)
            past, tokens = out.past_key_values, []
            for _ in range(max_new_tokens):
                token = int(out.logits[0, -1].argmax())
                tokens.append(token)
                out = self.model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
            self._memo[key] = tokens
        return self._memo[key]


GREEDY = {"temperature": 0.0, "ignore_eos": True}


@dataclass
class Collected:
    output_ids: list[int] = field(default_factory=list)
    finished_reason: FinishReason | None = None


def collect_tokens(outputs: list[object], tokens: dict[str, list[int]]) -> None:
    """Adds each request's new tokens among a scheduler call's outputs to tokens[rid]."""
    for out in outputs:
        if isinstance(out, ReqOutput):
            tokens.setdefault(out.rid, []).extend(out.new_token_ids)


def run_scheduler(scheduler: Scheduler, request: GenerateRequest) -> Collected:
    """Drives an in-process scheduler step by step until the request finishes."""
    result = Collected()

    def take(outputs: list[object]) -> None:
        for out in outputs:
            if isinstance(out, ReqOutput) and out.rid == request.rid:
                result.output_ids += out.new_token_ids
                result.finished_reason = out.finished_reason

    take(list(scheduler.handle(request)))
    while result.finished_reason is None:
        take(list(scheduler.step()))
    return result


def final_output(box: queue.Queue[Any], timeout: float = 60) -> Any:
    """The output that ends a request's stream (the callback puts each output in box)."""
    out = box.get(timeout=timeout)
    while out.finished_reason is None:
        out = box.get(timeout=timeout)
    return out


def assert_greedy_matches(
    engine: Engine, prompts: list[list[int]], oracle: GreedyOracle, max_new: int
) -> None:
    """The engine's greedy tokens for the prompts, batched, equal transformers'."""
    results = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": max_new})
    assert isinstance(results, list)
    assert_results_match(results, prompts, oracle, max_new)


def assert_results_match(
    results: list[dict[str, Any]], prompts: list[list[int]], oracle: GreedyOracle, max_new: int
) -> None:
    """Each result's tokens equal transformers' greedy continuation of its prompt, to the length."""
    for i, (res, prompt) in enumerate(zip(results, prompts, strict=True)):
        assert res["output_ids"] == oracle.continue_(prompt, max_new), (
            f"prompt {i} (len {len(prompt)}) differs"
        )
        assert res["meta_info"]["finish_reason"]["type"] == "length"


def assert_batched_and_cached_match(engine: Engine, oracle: GreedyOracle, max_new: int) -> None:
    """16 prompts of mixed lengths at once, then prompts sharing a 64-token prefix one after the
    other (cache hits): transformers' greedy tokens every time."""
    assert_greedy_matches(engine, random_prompts(16, seed=1), oracle, max_new)
    prefix = random_prompts(1, [64], seed=2)[0]
    for tail in random_prompts(3, seed=3):
        (res,) = engine.generate(
            input_ids=[prefix + tail], sampling_params={**GREEDY, "max_new_tokens": max_new}
        )
        assert res["output_ids"] == oracle.continue_(prefix + tail, max_new)
    assert res["meta_info"]["cached_tokens"] >= 64


def sampled_like_one_rank(engine: Engine, single: Engine, return_logprob: bool = False) -> list[Any]:
    """Seeded sampling and a regex grammar on several ranks give one rank's tokens; the results of
    both engines, pairwise."""
    requests: list[dict[str, Any]] = [
        {"temperature": 1.0, "top_p": 0.9, "seed": seed, "max_new_tokens": 16} for seed in range(6)
    ]
    requests += [{"temperature": 1.0, "seed": 7, "max_new_tokens": 16, "regex": r"[a-c]{2,4}-[0-9]{3}"}]
    prompts = random_prompts(len(requests), seed=4)
    many = engine.generate(input_ids=prompts, sampling_params=requests, return_logprob=return_logprob)
    one = single.generate(input_ids=prompts, sampling_params=requests, return_logprob=return_logprob)
    assert isinstance(many, list) and isinstance(one, list)
    assert [r["output_ids"] for r in many] == [r["output_ids"] for r in one]
    assert one[-1]["meta_info"]["finish_reason"]["type"] == "stop"
    return list(zip(many, one, strict=True))
