"""Turning a GenerateRequest into a Req: its prompt (ids, or vectors with stand-in ids) checked
against the scheduler's own state (request ids in use, the pool), its output budget clipped to
what fits, and its logprob, seed and logit-processor state set up. Its sampling parameters come
checked (where the request was made: runtime/request_builder.py, or SamplingParams.from_dict for a
caller that drives the scheduler itself). Refusals are InvalidRequestError (a 400)."""

from __future__ import annotations

import dataclasses
from collections.abc import Container
from typing import Any

import torch

from radixserve.executor.base import ExecutorInfo
from radixserve.protocol.messages import GenerateRequest, TokenLogprobs
from radixserve.protocol.prompts import PromptLimits
from radixserve.protocol.sampling_params import InvalidRequestError
from radixserve.scheduler.images import ImageEncoder
from radixserve.scheduler.logit_processors import ProcessorRegistry
from radixserve.scheduler.lora import LoraManager
from radixserve.scheduler.request import Req


class ReqFactory:
    def __init__(
        self,
        info: ExecutorInfo,
        logit_processors: ProcessorRegistry,
        lora: LoraManager | None,
        images: ImageEncoder | None = None,
        images_refused: str = "this model takes no images",
    ):
        self.info = info
        self.lora = lora
        # Vision-language models: None, with the reason, where image requests are refused.
        self.images = images
        self.images_refused = images_refused
        self.config = info.config
        self.logit_processors = logit_processors
        self.eos_token_ids = frozenset(self.config.eos_token_ids)
        self.prompt_limits = PromptLimits(info.context_len, info.max_total_tokens, allow_auto_truncate=False)
        self._next_stand_in_id = self.config.vocab_size

    def build(self, msg: GenerateRequest, root: Any, in_use: Container[str]) -> Req:
        """The request, its cache walk starting at root; in_use: the request ids taken."""
        info, ids, vectors = self.info, list(msg.input_ids), None
        # A copy: the budget below is clipped per request.
        params = dataclasses.replace(msg.sampling_params)
        processor = None
        if msg.custom_logit_processor is not None:
            processor = self.logit_processors.get(msg.custom_logit_processor)
        if msg.input_embeds is not None:
            vectors = self._prompt_vectors(msg.input_embeds)
            ids = self._stand_in_ids(len(vectors))
        self._validate_input(msg.rid, ids, in_use, real_ids=vectors is None)
        if msg.lora_path is not None and self.lora is None:
            raise InvalidRequestError(
                "lora_path names a LoRA adapter, but the server runs without --enable-lora"
            )
        if msg.images and (self.images is None or vectors is not None or msg.logprob_start_len >= 0):
            raise InvalidRequestError(
                self.images_refused
                if self.images is None
                else "images take no input_embeds or prompt logprobs"
            )
        if info.is_embedding:
            params.max_new_tokens = 0  # the prompt's pass gives the embedding; nothing is sampled
        # Clip to what the context and the whole KV pool can hold, so a lone request always fits.
        params.max_new_tokens = min(
            params.max_new_tokens, info.context_len - len(ids), info.max_total_tokens - len(ids)
        )
        req = Req(
            msg.rid,
            ids,
            params,
            eos_token_ids=self.eos_token_ids,
            last_node=root,
            input_embeds=vectors,
            return_hidden_states=msg.return_hidden_states,
            logit_processor=processor,
            priority=msg.priority or 0,
            stream=msg.stream,
        )
        if self.lora is not None:
            self.lora.attach(req, msg.lora_path)
        if msg.images and self.images is not None:
            self.images.attach(req, msg.images)
        if params.seed is not None:
            req.generator = torch.Generator(device=info.device).manual_seed(params.seed)
        if msg.return_logprob:
            req.logprobs = TokenLogprobs()
            req.top_logprobs_num = msg.top_logprobs_num
            req.token_ids_logprob = msg.token_ids_logprob
            if msg.logprob_start_len >= 0:
                req.input_logprobs = TokenLogprobs()
                req.input_logprob_next = max(1, msg.logprob_start_len)
        return req

    def _prompt_vectors(self, rows: list[list[float]]) -> torch.Tensor:
        hidden = self.config.hidden_size
        if not rows or any(len(row) != hidden for row in rows):
            raise InvalidRequestError(f"input_embeds must be a non-empty list of vectors of {hidden} numbers")
        return torch.tensor(rows, dtype=self.info.dtype, device=self.info.device)

    def _stand_in_ids(self, length: int) -> list[int]:
        """Ids for a prompt given as vectors: above the vocabulary and never reused, so the radix
        cache cannot match them against any other prompt (only the request's own, on resume)."""
        first = self._next_stand_in_id
        self._next_stand_in_id += length
        return list(range(first, first + length))

    def _validate_input(self, rid: str, ids: list[int], in_use: Container[str], real_ids: bool) -> None:
        if rid in in_use:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.config.vocab_size
        if real_ids and (min(ids) < 0 or max(ids) >= vocab):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        # The engine checked (or cut) the length already; the scheduler can be driven directly.
        self.prompt_limits.allowed_prompt_len(len(ids), embed=self.info.is_embedding)
