"""/tokenize and /detokenize (vLLM's shapes), and --chat-template, through the HTTP server."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from transformers import AutoTokenizer

from tests.server.conftest import LiveServer

SHARED_SERVER = True
CHAT = [{"role": "user", "content": "Hello there"}]


def test_a_prompt_and_a_chat_tokenize_as_the_tokenizer_does(
    server: LiveServer, tiny_model_dir: Callable[[str], Path]
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir("llama"))
    with server.client() as client:
        plain = client.post("/tokenize", json={"prompt": "def main():", "return_token_strs": True}).json()
        ids = tokenizer("def main():").input_ids
        assert plain["tokens"] == ids and plain["count"] == len(ids)
        assert plain["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
        assert plain["max_model_len"] == client.get("/get_model_info").json()["context_length"]
        chat = client.post("/tokenize", json={"messages": CHAT}).json()
        text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
        assert chat["tokens"] == tokenizer.encode(text, add_special_tokens=False)
        assert chat["token_strs"] is None
        bare = client.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
        assert len(bare["tokens"]) < len(chat["tokens"])
        back = client.post("/detokenize", json={"tokens": ids}).json()
        assert back == {"prompt": tokenizer.decode(ids)}


def test_bad_bodies_are_a_400_naming_the_field(server: LiveServer) -> None:
    with server.client() as client:
        for route, body, param in [
            ("/tokenize", {}, "prompt"),
            ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
            ("/tokenize", {"prompt": 7}, "prompt"),
            ("/tokenize", {"messages": "hi"}, "messages"),
            ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
            (
                "/tokenize",
                {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}},
                "chat_template_kwargs",
            ),
            ("/detokenize", {"tokens": "12"}, "tokens"),
            ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ]:
            answer = client.post(route, json=body)
            assert answer.status_code == 400, (route, body, answer.text)
            assert answer.json()["error"]["param"] == param, (route, body, answer.json())
