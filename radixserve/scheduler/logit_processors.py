"""Custom logit processors (--enable-custom-logit-processor).

SGLang ships a processor to the server as a dill-pickled callable; radixserve never unpickles
anything from a client. A request names a processor instead: "module.path:ClassName", a class
importable in the server's environment (installed or on its PYTHONPATH), plus JSON arguments in
sampling_params["custom_params"]. Naming code the server already has is still running code on the
server's behalf, so it is off unless the server is started with the flag.

A processor is called once per step for all the rows that use it:

    class MyProcessor:
        def __call__(self, logits: torch.Tensor, params: list[dict]) -> torch.Tensor: ...

`logits` holds those rows ([rows, vocab], float32); `params` holds each row's custom_params ({}
when none). It returns logits of the same shape. It runs before penalties, temperature and
top-k/p; logprobs stay those of the raw model.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from radixserve.protocol.sampling_params import InvalidRequestError


class LogitProcessor(Protocol):
    def __call__(self, logits: torch.Tensor, params: list[dict[str, Any]]) -> torch.Tensor: ...


class DisallowedTokens:
    """Bans the token ids in custom_params["token_ids"] (SGLang's DisallowedTokensLogitsProcessor)."""

    def __call__(self, logits: torch.Tensor, params: list[dict[str, Any]]) -> torch.Tensor:
        for row, args in enumerate(params):
            ids = args.get("token_ids") or []
            if ids:
                logits[row, torch.tensor(ids, device=logits.device)] = float("-inf")
        return logits


class ProcessorRegistry:
    """Processors by name, imported and instantiated once each."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._loaded: dict[str, LogitProcessor] = {}

    def get(self, name: str) -> LogitProcessor:
        if not self.enabled:
            raise InvalidRequestError(
                "custom logit processors are disabled; start the server with --enable-custom-logit-processor"
            )
        if name not in self._loaded:
            self._loaded[name] = self._load(name)
        return self._loaded[name]

    @staticmethod
    def _load(name: str) -> LogitProcessor:
        module_name, _, attr = name.partition(":")
        if not module_name or not attr:
            raise InvalidRequestError(
                f"custom_logit_processor must name a class as 'module.path:ClassName', got {name!r}"
            )
        try:
            target = getattr(importlib.import_module(module_name), attr)
            processor = target() if isinstance(target, type) else target
        except Exception as exc:
            raise InvalidRequestError(f"cannot load custom logit processor {name!r}: {exc}") from exc
        if not callable(processor):
            raise InvalidRequestError(f"custom logit processor {name!r} is not callable")
        loaded: LogitProcessor = processor
        return loaded


@dataclass
class Processed:
    logits: torch.Tensor
    errors: list[str | None]  # per row: why its processor failed (its logits are then left as they were)


def apply_processors(
    logits: torch.Tensor,
    processors: Sequence[LogitProcessor | None],
    params: Sequence[dict[str, Any] | None],
) -> Processed:
    """Logits with each row passed through its processor (one call per processor); the input is
    left as it was (it still serves the raw logprobs)."""
    errors: list[str | None] = [None] * len(processors)
    if all(p is None for p in processors):
        return Processed(logits, errors)
    out = logits.clone()
    groups: dict[int, list[int]] = {}
    for row, processor in enumerate(processors):
        if processor is not None:
            groups.setdefault(id(processor), []).append(row)
    for rows in groups.values():
        processor = processors[rows[0]]
        assert processor is not None
        index = torch.tensor(rows, device=logits.device)
        try:
            result = processor(out[index].clone(), [params[r] or {} for r in rows])
            if not isinstance(result, torch.Tensor) or result.shape != (len(rows), logits.shape[1]):
                raise TypeError(f"it must return a tensor of shape {(len(rows), logits.shape[1])}")
        except Exception as exc:  # the client's processor: its failure must not stop the server
            for row in rows:
                errors[row] = f"{type(exc).__name__}: {exc}"
            continue
        out[index] = result.to(out.dtype)
    return Processed(out, errors)
