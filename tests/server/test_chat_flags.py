"""--chat-template (a file, or the template inline, replaces the model's, for chat completions and
/tokenize alike), and --reasoning-parser's split of a reply."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from transformers import AutoTokenizer

from tests.server.conftest import LiveServer

TEMPLATE = (
    "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}{% if add_generation_prompt %}=>{% endif %}"
)


def test_a_file_or_an_inline_template_replaces_the_models(
    tiny_model_dir: Callable[[str], Path], start_server: Callable[..., LiveServer], tmp_path: Path
) -> None:
    model = tiny_model_dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(model)
    expected = tokenizer.encode("<<Hello>>=>", add_special_tokens=False)
    template_file = tmp_path / "template.jinja"
    template_file.write_text(TEMPLATE)
    for value in (str(template_file), TEMPLATE):
        server = start_server(model, "--chat-template", value)
        with server.client() as client:
            ids = client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hello"}]})
            assert ids.json()["tokens"] == expected
            chat = client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2},
            )
            assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(expected)
        server.assert_idle_and_kv_intact()
        server.stop()  # one server at a time on 2 cores


def test_reasoning_comes_apart_from_the_answer_streamed_or_not(
    tiny_model_dir: Callable[[str], Path], start_server: Callable[..., LiveServer]
) -> None:
    """--reasoning-parser qwen3: a grammar makes the tiny model write a <think> block, then an answer."""
    server = start_server(tiny_model_dir("llama"), "--reasoning-parser", "qwen3")
    body = {
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 40,
        "temperature": 0,
        "regex": "<think>[a-z]{3}</think>[a-z]{3}",
    }
    with server.client() as client:
        message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        reasoning, content = message["reasoning_content"], message["content"]
        assert len(reasoning) == 3 and reasoning.isalpha() and len(content) == 3 and content.isalpha()
        streamed = {"reasoning_content": "", "content": ""}
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as answer:
            for line in answer.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        for key in streamed:
                            streamed[key] += choice["delta"].get(key) or ""
        assert streamed == {"reasoning_content": reasoning, "content": content}
        # enable_thinking false turns the parser off for the request: the reply is all answer.
        off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
        message = client.post("/v1/chat/completions", json=off).json()["choices"][0]["message"]
        assert message["content"] == f"<think>{reasoning}</think>{content}"
        assert "reasoning_content" not in message
    server.assert_idle_and_kv_intact()
