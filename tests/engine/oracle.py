"""Test helpers: deterministic prompts and a transformers greedy oracle."""

from __future__ import annotations

import queue
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from radixserve.protocol.messages import FinishReason, GenerateRequest, ReqOutput
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

    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self._memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    @torch.no_grad()
    def continue_(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in self._memo:
            out = self.model(input_ids=torch.tensor([prompt]), use_cache=True)
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
