"""Images behind a live server (a tiny LLaVA): /generate's image_data, OpenAI chat image_url parts
(streamed and not), an http URL fetched only with --enable-image-url-fetch, and bad images
answered with a 400 in OpenAI's error shape while the server keeps serving. Outputs equal
transformers' (fp32 greedy)."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.engine.test_multimodal import IMAGE_TOKEN, ONE, LlavaOracle, data_url, png
from tests.server.conftest import LiveServer

MAX_NEW = 8
PARAMS = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


@pytest.fixture
def image_site(tmp_path: Path) -> Iterator[str]:
    """An http server on 127.0.0.1 serving one PNG at /a.png; yields its URL."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "a.png").write_bytes(png(31))

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(site), **kwargs)  # type: ignore[arg-type]

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/a.png"
    server.shutdown()


def test_images_over_http(
    start_server: Callable[..., LiveServer], tiny_llava_dir: Path, image_site: str
) -> None:
    oracle = LlavaOracle(tiny_llava_dir)
    server = start_server(tiny_llava_dir, "--enable-image-url-fetch")
    a = png(30)
    with server.client() as client:
        # /generate with image_data, a batch of two prompts.
        response = client.post(
            "/generate",
            json={
                "text": [ONE, ONE],
                "image_data": [data_url(a), [data_url(png(31))]],
                "sampling_params": PARAMS,
            },
        )
        response.raise_for_status()
        results = response.json()
        assert results[0]["output_ids"] == oracle.continue_(ONE, [a])
        assert results[1]["output_ids"] == oracle.continue_(ONE, [png(31)])
        # An http URL, fetched because the flag allows it: the same image as png(31).
        fetched = client.post(
            "/generate", json={"text": ONE, "image_data": image_site, "sampling_params": PARAMS}
        )
        fetched.raise_for_status()
        assert fetched.json()["output_ids"] == results[1]["output_ids"]

        # OpenAI chat: image_url parts take the place of the model's image token.
        content = [
            {"type": "text", "text": "What is in "},
            {"type": "image_url", "image_url": {"url": data_url(a)}},
            {"type": "text", "text": "?"},
        ]
        chat = {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_NEW, "temperature": 0}
        reply = client.post("/v1/chat/completions", json=chat)
        reply.raise_for_status()
        text = oracle.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is in {IMAGE_TOKEN}?"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        native = client.post(
            "/generate", json={"text": text, "image_data": data_url(a), "sampling_params": PARAMS}
        ).json()
        assert native["output_ids"] == oracle.continue_(text, [a])
        assert reply.json()["choices"][0]["message"]["content"] == native["text"]
        assert reply.json()["usage"]["prompt_tokens"] == native["meta_info"]["prompt_tokens"]
        streamed = ""
        with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        streamed += choice["delta"].get("content") or ""
        assert streamed == native["text"]

        # Bad images: a 400 in OpenAI's error shape; the server keeps serving.
        for bad, message in [
            (data_url(b"\x89PNG\r\n\x1a\n broken"), "could not be decoded"),
            ("data:image/png;base64,!!", "not valid base64"),
        ]:
            refused = client.post(
                "/v1/chat/completions",
                json={
                    **chat,
                    "messages": [
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": bad}}]}
                    ],
                },
            )
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert message in error["message"] and error["type"] == "invalid_request_error"
        missing_url = client.post(
            "/v1/chat/completions",
            json={
                **chat,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            },
        )
        assert missing_url.status_code == 400
        again = client.post("/v1/chat/completions", json=chat)
        assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == native["text"]


def test_a_text_model_answers_images_with_a_400(
    start_server: Callable[..., LiveServer], tiny_model_dir: Callable[[str], Path]
) -> None:
    server = start_server(tiny_model_dir("llama"))
    content = [{"type": "image_url", "image_url": {"url": data_url(png(1))}}]
    with server.client() as client:
        response = client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": content}], "max_tokens": 2}
        )
        assert response.status_code == 400 and "takes no images" in response.json()["error"]["message"]
        plain = client.post(
            "/generate", json={"text": "hi", "image_data": data_url(png(1)), "sampling_params": PARAMS}
        )
        assert plain.status_code == 400 and "takes no images" in plain.json()["error"]["message"]
