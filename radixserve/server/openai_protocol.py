"""Request bodies of the OpenAI-compatible API, and how they become sampling parameters.

Unknown fields are ignored, as OpenAI's own SDKs may send newer ones. Fields radixserve does not
implement (`suffix`, `best_of` other than n, non-text message parts) are refused with a clear 400
when set, never silently ignored.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from radixserve.protocol.sampling_params import ANY_JSON, SamplingParams
from radixserve.server.errors import ApiError
from radixserve.server.limits import (
    MAX_BATCH,
    MAX_TOP_LOGPROBS,
    check_batch,
    check_token_ids,
    parse_sampling_params,
)

# Native sampling names as the OpenAI body spells them, for the `param` of an error.
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """What completions and chat share: OpenAI's sampling fields plus SGLang's extras."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # SGLang extras
    top_k: int | None = None
    # sglang-router --pd-disaggregation's (server/bootstrap_fields.py).
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None
    # --enable-priority-scheduling: SGLang's request priority (ignored without the flag).
    priority: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Structured output: OpenAI's response_format, or SGLang's extras (at most one).
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None

    def refuse_unsupported(self) -> None:
        if self.n < 1:
            raise ApiError(400, f"n must be >= 1, got {self.n}", param="n")
        if self.n > MAX_N:
            raise ApiError(400, f"n must be <= {MAX_N}, got {self.n}", param="n")

    def sampling_params(
        self, max_tokens: int | None, default_max_tokens: int, tool_grammar: dict[str, str] | None = None
    ) -> SamplingParams:
        """The native sampling parameters; SamplingParams validates the values. tool_grammar: the
        grammar that enforces a required or named tool call (server/tool_calls.py), which no
        grammar of the request's own may join."""
        params: dict[str, Any] = {
            "max_new_tokens": default_max_tokens if max_tokens is None else max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "ignore_eos": self.ignore_eos,
            "min_new_tokens": self.min_tokens,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "no_stop_trim": self.no_stop_trim,
        }
        if self.stop is not None:
            params["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        for name in (
            "seed", "top_k", "min_p", "stop_token_ids",
            "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
            "regex", "json_schema", "ebnf",
        ):  # fmt: skip
            value = getattr(self, name)
            if value is not None:
                params[name] = value
        params.update(self._response_format_grammar())
        if tool_grammar:
            own = [name for name in ("regex", "json_schema", "ebnf") if name in params]
            if own:
                raise ApiError(
                    400,
                    "tool_choice 'required' or a named function is enforced by a grammar, which "
                    f"cannot be combined with the request's own ({own[0]} or response_format)",
                    param="tool_choice",
                )
            params.update(tool_grammar)
        return parse_sampling_params(params, "", _OPENAI_NAMES)

    def _response_format_grammar(self) -> dict[str, str]:
        """OpenAI's response_format as a grammar: any JSON object, or JSON under a schema."""
        fmt = self.response_format
        if fmt is None or fmt.get("type") == "text":
            return {}
        if fmt.get("type") == "json_object":
            return {"json_schema": ANY_JSON}
        if fmt.get("type") == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ApiError(
                    400,
                    "response_format.json_schema.schema must be a JSON schema object",
                    param="response_format",
                )
            return {"json_schema": json.dumps(spec["schema"])}
        raise ApiError(400, f"unknown response_format type {fmt.get('type')!r}", param="response_format")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# One request asking for hundreds of choices is almost certainly a mistake.
MAX_N = 128


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    # How many top alternatives per token to return with each token's logprob (None: no logprobs).
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def logprob_request(self) -> tuple[bool, int, int]:
        """(return logprobs, top alternatives per token, first prompt position with logprobs);
        echo with logprobs scores the prompt too, as lm-eval's loglikelihood requests do."""
        if self.logprobs is None:
            return False, 0, -1
        return True, self.logprobs, 0 if self.echo else -1

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.suffix:
            raise ApiError(400, "'suffix' is not supported yet by radixserve", param="suffix")
        if self.best_of not in (None, 1, self.n):
            raise ApiError(400, "'best_of' other than n is not supported yet by radixserve", param="best_of")

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts, each a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            check_token_ids(prompt, "prompt")
            return [list(prompt)]  # type: ignore[arg-type]
        check_batch(len(prompt), "prompt")
        if len(prompt) * self.n > MAX_BATCH:
            # Each prompt runs n times: the requests of one call are bounded as its prompts are.
            raise ApiError(
                400,
                f"{len(prompt)} prompts x n={self.n} make {len(prompt) * self.n} choices; "
                f"at most {MAX_BATCH} per request",
                param="n",
            )
        for index, item in enumerate(prompt):
            if isinstance(item, list):
                check_token_ids(item, f"prompt[{index}]")
        return list(prompt)  # type: ignore[arg-type]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallMessage(BaseModel):
    """An assistant message's tool call, as clients send it back in the history."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_dict(self) -> dict[str, Any]:
        # Chat templates (Qwen2.5's, Llama 3's, Mistral's) render arguments as a mapping (tojson).
        try:
            arguments: Any = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            arguments = self.function.arguments
        call = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": call}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None

    def image_urls(self) -> list[str]:
        """The urls of this message's image_url parts, in order."""
        urls = []
        for part in self.content if isinstance(self.content, list) else []:
            if part.get("type") == "image_url":
                image = part.get("image_url")
                url = image.get("url") if isinstance(image, dict) else image
                if not isinstance(url, str) or not url:
                    raise ApiError(400, "an image_url part needs image_url.url", param="messages")
                urls.append(url)
        return urls

    def template_dict(self, image_token: str | None = None) -> dict[str, Any]:
        """The message as chat templates take it: its text, each image_url part replaced by
        image_token (the model's text for one image; None: images are refused)."""
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type")
                if kind == "image_url" and image_token is not None:
                    texts.append(image_token)
                    continue
                if kind == "image_url":
                    raise ApiError(400, "this model takes no images", param="messages")
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(
                        400, f"message content of type {kind!r} is not supported", param="messages"
                    )
                texts.append(part["text"])
            content = "".join(texts)
        # Chat templates know "system"; OpenAI's newer "developer" role means the same.
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1)
    description: str | None = None
    # A JSON schema of the arguments object (None: any object).
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: ChosenFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    # "none", "auto", "required", or {"type": "function", "function": {"name": ...}} (tool_calls.py).
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def logprob_request(self) -> tuple[bool, int]:
        """(return logprobs, top alternatives per token)."""
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ApiError(
                400,
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
                param="top_logprobs",
            )
        return self.logprobs, self.top_logprobs or 0

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
