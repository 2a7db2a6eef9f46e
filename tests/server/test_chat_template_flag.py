"""--chat-template: a file, or the template inline, replaces the model's, for chat completions and
/tokenize alike."""

from __future__ import annotations

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
        server.stop()
