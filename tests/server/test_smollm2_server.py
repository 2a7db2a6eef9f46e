"""The default model (the packaged SmolLM2-135M-Instruct GGUF) served over HTTP."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def test_default_model_answers_over_http(smollm2_gguf_path: Path, start_server: Any) -> None:
    live = start_server(None, "--served-model-name", "smollm2")
    client = live.openai()
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    completion = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert completion.choices[0].text.startswith(" Paris")

    messages: Any = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    chat = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=16, temperature=0)
    answer = chat.choices[0].message.content or ""
    assert "Paris" in answer and chat.choices[0].finish_reason == "stop"
    # The chat template's end-of-turn token is special: it ends the answer and is not in the text.
    assert "<|im_end|>" not in answer
    streamed = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == answer
