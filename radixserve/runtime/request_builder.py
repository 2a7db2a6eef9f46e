"""Turning a caller's prompt and options into GenerateRequests for the scheduler.

Everything the scheduler would refuse is refused here first, with an InvalidRequestError naming
the problem, so that a caller hears of it before anything is queued.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from radixserve.protocol.messages import GenerateRequest
from radixserve.protocol.prompts import (
    InputEmbeds,
    InputIds,
    Prompt,
    PromptLimits,
    check_input_embeds,
    split_prompts,
)
from radixserve.protocol.sampling_params import InvalidRequestError, SamplingParams
from radixserve.runtime.images import ImagePreprocessor
from radixserve.runtime.sessions import SessionParams, SessionStore

SamplingArg = dict[str, Any] | list[dict[str, Any]] | None

# Top alternatives per token a request may ask for (vLLM's and SGLang's usual bound).
MAX_TOP_LOGPROBS = 20


@dataclass
class RequestBuilder:
    """The engine's model as requests see it: vocabulary, hidden size, kind, prompt limits."""

    vocab_size: int
    hidden_size: int
    is_embedding: bool
    allow_custom_logit_processor: bool
    limits: PromptLimits
    sessions: SessionStore
    tokenize: Callable[[str], list[int]]
    # --enable-lora: the adapters loaded (the engine's own table, kept current); None without.
    lora_adapters: Mapping[str, str] | None = None
    # Vision-language models: the image processor and limits; None for a model without images.
    images: ImagePreprocessor | None = None
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def new_rid(self) -> str:
        return f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"

    def build(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams | dict[str, Any] | None,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        token_ids_logprob: list[int] | None = None,
        session_params: dict[str, Any] | None = None,
        *,
        embed: bool = False,
        input_embeds: list[list[float]] | None = None,
        return_hidden_states: bool = False,
        custom_logit_processor: str | None = None,
        lora_path: str | None = None,
        image_data: list[Any] | None = None,
    ) -> GenerateRequest:
        """Validates everything the scheduler would refuse, so that callers get the error up front.
        With return_logprob and logprob_start_len >= 0, prompt logprobs come back too. embed: an
        embedding request, which only an embedding model serves (and it serves nothing else).
        input_embeds: the prompt as embedding vectors instead of ids (input_ids then empty).
        sampling_params: as sent (checked here, SamplingParams.from_dict), or a SamplingParams the
        HTTP edge made from the body (checked there, to name the client's field)."""
        if embed and not self.is_embedding:
            raise InvalidRequestError(
                "this model generates text and does not serve embeddings; start the server with an "
                "embedding model (e.g. a BERT/sentence-transformers folder) or with --is-embedding"
            )
        if self.is_embedding and not embed:
            raise InvalidRequestError(
                "this server runs an embedding model; use /v1/embeddings or /encode (Engine.encode)"
            )
        if embed and (return_logprob or session_params is not None):
            raise InvalidRequestError("embedding requests take no logprobs or sessions")
        if custom_logit_processor is not None and not self.allow_custom_logit_processor:
            raise InvalidRequestError(
                "custom logit processors are disabled; start the server with --enable-custom-logit-processor"
            )
        if lora_path is not None:
            self._check_adapter(lora_path)
        if not isinstance(top_logprobs_num, int) or not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs_num!r}"
            )
        params = (
            sampling_params
            if isinstance(sampling_params, SamplingParams)
            else SamplingParams.from_dict(sampling_params)
        )
        params.check_vocab(self.vocab_size)
        ids = list(input_ids)
        session_id = session_parent = None
        if session_params is not None:
            wanted = SessionParams.from_dict(session_params)
            ids, session_parent = self.sessions.prompt(wanted, ids)
            session_id = wanted.id
        images = None
        if image_data:
            if self.images is None:
                raise InvalidRequestError("this model takes no images (image_data / image_url parts)")
            if input_embeds is not None or embed or session_id is not None or logprob_start_len >= 0:
                raise InvalidRequestError("images take no input_embeds, sessions or prompt logprobs")
            ids, images = self.images.expand(ids, image_data)
            if self.limits.allowed_prompt_len(len(ids), embed) < len(ids):
                raise InvalidRequestError(
                    f"the prompt with its images is {len(ids)} tokens, more than fits; it is not "
                    "truncated, as that could cut an image"
                )
        if input_embeds is not None:
            if ids or embed or session_id is not None or (return_logprob and logprob_start_len >= 0):
                raise InvalidRequestError(
                    "input_embeds replaces the prompt: it takes no input_ids, sessions or prompt logprobs"
                )
            check_input_embeds(input_embeds, self.hidden_size)
            input_embeds = input_embeds[: self.limits.allowed_prompt_len(len(input_embeds), embed)]
        else:
            if not ids:
                raise InvalidRequestError("the prompt is empty")
            if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
                raise InvalidRequestError(f"prompt token ids must be integers in [0, {self.vocab_size})")
            ids = ids[: self.limits.allowed_prompt_len(len(ids), embed)]
        if not isinstance(logprob_start_len, int) or not -1 <= logprob_start_len < max(len(ids), 1):
            raise InvalidRequestError(
                f"logprob_start_len must be -1 (no prompt logprobs) or in [0, {len(ids)}) for this "
                f"{len(ids)}-token prompt, got {logprob_start_len!r}"
            )
        if token_ids_logprob is not None and (
            not isinstance(token_ids_logprob, list)
            or any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in token_ids_logprob)
        ):
            raise InvalidRequestError(
                f"token_ids_logprob must be a list of token ids in [0, {self.vocab_size})"
            )
        return GenerateRequest(
            rid or self.new_rid(),
            ids,
            params,
            bool(return_logprob),
            top_logprobs_num,
            logprob_start_len if return_logprob else -1,
            list(token_ids_logprob) if return_logprob and token_ids_logprob else None,
            session_id,
            session_parent,
            input_embeds,
            bool(return_hidden_states),
            custom_logit_processor,
            lora_path=lora_path,
            images=images,
        )

    def _check_adapter(self, name: object) -> None:
        if self.lora_adapters is None:
            raise InvalidRequestError(
                "lora_path names a LoRA adapter; this server runs without --enable-lora"
            )
        if not isinstance(name, str) or name not in self.lora_adapters:
            loaded = ", ".join(sorted(self.lora_adapters)) or "none"
            raise InvalidRequestError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded})")

    def build_batch(
        self,
        prompt: Prompt,
        input_ids: InputIds,
        sampling_params: SamplingArg,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
        token_ids_logprob: list[int] | None = None,
        embed: bool = False,
        input_embeds: InputEmbeds = None,
        return_hidden_states: bool = False,
        custom_logit_processor: str | None = None,
        lora_path: str | list[str | None] | None = None,
        image_data: Any = None,
        priority: int | list[int | None] | None = None,
    ) -> tuple[list[GenerateRequest], bool]:
        """lora_path and priority: one for every prompt, or a list with one per prompt (SGLang's).
        image_data: for one prompt an image or a list of them; for a batch, one entry (an image, a
        list, or None) per prompt (SGLang's shape)."""
        batch = split_prompts(prompt, input_ids, input_embeds, self.tokenize)
        batch_ids, batch_embeds, single = batch.ids, batch.embeds, batch.single
        per_prompt_images = images_per_prompt(image_data, single, len(batch_ids))
        adapters = _per_prompt(lora_path, len(batch_ids), "lora_path")
        priorities = _per_prompt(priority, len(batch_ids), "priority")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(batch_ids):
                raise InvalidRequestError("sampling_params list must have one entry per prompt")
            params = sampling_params
        else:
            params = [dict(sampling_params or {}) for _ in batch_ids]
        reqs = [
            self.build(
                ids,
                p,
                None,
                return_logprob,
                top_logprobs_num,
                logprob_start_len,
                token_ids_logprob,
                embed=embed,
                input_embeds=vectors,
                return_hidden_states=return_hidden_states,
                custom_logit_processor=custom_logit_processor,
                lora_path=adapter,
                image_data=images,
            )
            for ids, p, vectors, adapter, images in zip(
                batch_ids, params, batch_embeds, adapters, per_prompt_images, strict=True
            )
        ]
        for req, value in zip(reqs, priorities, strict=True):
            req.priority = value
        return reqs, single


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise InvalidRequestError(f"{name} list must have one entry per prompt")
    return value


def images_per_prompt(image_data: Any, single: bool, num_prompts: int) -> list[list[Any] | None]:
    if image_data is None:
        return [None] * num_prompts
    if single:
        return [list(image_data) if isinstance(image_data, list) else [image_data]]
    if not isinstance(image_data, list) or len(image_data) != num_prompts:
        raise InvalidRequestError("image_data for a batch of prompts must have one entry per prompt")
    return [None if x is None else list(x) if isinstance(x, list) else [x] for x in image_data]
