"""`radixserve bench serving`: datasets, metric math, and runs against a fake OpenAI SSE server."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from radixserve.cli import build_parser, main
from radixserve_tools.bench.cli import _serving_base_url
from radixserve_tools.bench.serving import (
    RequestResult,
    ServingBenchConfig,
    ServingBenchError,
    compute_metrics,
    percentile,
    request_body,
    run_serving_benchmark,
)
from radixserve_tools.bench.serving_datasets import (
    TOKEN_ID_LO,
    BenchRequest,
    sample_generated_shared_prefix_requests,
    sample_random_requests,
    sample_sharegpt_requests,
)

# ---------------------------------------------------------------------------------------------
# A tiny OpenAI-compatible streaming server, run by uvicorn in a thread.
#   /ok/...      streams max_tokens text chunks, then a usage chunk, then [DONE]
#   /nousage/... the same without the usage chunk (a server ignoring stream_options)
#   /fail/...    HTTP 500
# ---------------------------------------------------------------------------------------------

CHUNK_SLEEP_S = 0.002


@dataclass
class FakeServerState:
    base: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    def url(self, mode: str) -> str:
        return f"{self.base}/{mode}"

    def reset(self) -> None:
        self.bodies.clear()
        self.headers.clear()
        self.in_flight = self.max_in_flight = 0


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _prompt_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        return len(body["messages"][0]["content"].split())
    prompt = body["prompt"]
    return len(prompt) if isinstance(prompt, list) else len(prompt.split())


async def _stream(state: FakeServerState, body: dict[str, Any], usage: bool) -> AsyncIterator[str]:
    chat = "messages" in body
    n = body["max_tokens"]
    if chat:
        # Real servers open a chat stream with a role-only delta: it must not count as the first token.
        yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    for i in range(n):
        await asyncio.sleep(CHUNK_SLEEP_S)
        choice = {"index": 0, "delta": {"content": f"t{i} "}} if chat else {"index": 0, "text": f"t{i} "}
        yield _sse(
            {"choices": [{**choice, "finish_reason": "length" if i == n - 1 else None}], "usage": None}
        )
    if usage:
        counts = {"prompt_tokens": _prompt_tokens(body), "completion_tokens": n}
        yield _sse({"choices": [], "usage": {**counts, "total_tokens": sum(counts.values())}})
    # Leave in-flight before [DONE]: the client frees its concurrency slot only after reading it.
    state.in_flight -= 1
    yield "data: [DONE]\n\n"


def _make_app(state: FakeServerState) -> FastAPI:
    app = FastAPI()

    @app.get("/{mode}/v1/models")
    async def models(mode: str) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def generate(mode: str, request: Request) -> Any:
        body = await request.json()
        state.bodies.append(body)
        state.headers.append(dict(request.headers))
        if mode == "fail":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        return StreamingResponse(
            _stream(state, body, usage=mode != "nousage"), media_type="text/event-stream"
        )

    app.post("/{mode}/v1/completions")(generate)
    app.post("/{mode}/v1/chat/completions")(generate)
    return app


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServerState]:
    state = FakeServerState()
    # Bind first and hand uvicorn the socket: a free port without a pick-then-bind race.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    state.base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    uv = uvicorn.Server(uvicorn.Config(_make_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "fake server did not start"
        time.sleep(0.01)
    yield state
    uv.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def fake(server: FakeServerState) -> FakeServerState:
    server.reset()
    return server


def _run(**kwargs: Any) -> Any:
    cfg = ServingBenchConfig(**{"disable_tqdm": True, **kwargs})
    return asyncio.run(run_serving_benchmark(cfg))


# ---------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------


def test_random_dataset_lengths_ids_and_seed() -> None:
    fixed = sample_random_requests(20, 32, 8, range_ratio=1.0, vocab_size=500, seed=3)
    assert len(fixed) == 20
    for r in fixed:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len == 32 and r.output_len == 8
        assert all(TOKEN_ID_LO <= t < 500 for t in r.prompt)

    ranged = sample_random_requests(200, 100, 40, range_ratio=0.5, seed=3)
    assert all(50 <= r.prompt_len <= 100 and 20 <= r.output_len <= 40 for r in ranged)
    assert len({r.prompt_len for r in ranged}) > 10  # actually spread, not pinned to an end

    assert sample_random_requests(5, 16, 4, seed=7) == sample_random_requests(5, 16, 4, seed=7)
    assert sample_random_requests(5, 16, 4, seed=7) != sample_random_requests(5, 16, 4, seed=8)
    with pytest.raises(ValueError, match="range ratio"):
        sample_random_requests(1, 8, 8, range_ratio=1.5)
    with pytest.raises(ValueError, match="vocab"):
        sample_random_requests(1, 8, 8, vocab_size=TOKEN_ID_LO)


def test_generated_shared_prefix_groups_share_exactly_the_system_prompt() -> None:
    reqs = sample_generated_shared_prefix_requests(
        num_groups=3, prompts_per_group=4, system_prompt_len=16, question_len=5, output_len=7, seed=1
    )
    assert len(reqs) == 12
    assert all(r.prompt_len == len(r.prompt) == 21 and r.output_len == 7 for r in reqs)
    groups: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for r in reqs:
        assert isinstance(r.prompt, list)
        groups.setdefault(tuple(r.prompt[:16]), []).append(tuple(r.prompt[16:]))
    assert sorted(len(q) for q in groups.values()) == [4, 4, 4]
    assert len({q for qs in groups.values() for q in qs}) == 12  # every question differs
    # Shuffled: the first four requests are not simply group 0.
    assert len({tuple(r.prompt[:16]) for r in reqs[:4]}) > 1


def _write_sharegpt(path: Path) -> Path:
    def conv(*turns: tuple[str, str]) -> dict[str, Any]:
        return {"id": "x", "conversations": [{"from": f, "value": v} for f, v in turns]}

    data = [
        conv(("human", "What is a radix tree?"), ("gpt", "A" * 40)),
        conv(("human", "only one turn")),  # < 2 turns: skipped
        {"id": "no-conversations"},  # malformed: skipped
        conv(("system", "be nice"), ("human", "Hello there"), ("gpt", "Hi! " * 5)),  # pair found later
        conv(("human", "   "), ("gpt", "empty prompt")),  # blank prompt: skipped
        conv(("human", "Third"), ("gpt", "")),  # empty answer: at least one token
    ]
    path.write_text(json.dumps(data))
    return path


def test_sharegpt_parsing_without_tokenizer(tmp_path: Path) -> None:
    path = _write_sharegpt(tmp_path / "sg.json")
    reqs = sample_sharegpt_requests(path, num_prompts=100, seed=0)
    by_prompt = {r.prompt: r for r in reqs}
    assert set(by_prompt) == {"What is a radix tree?", "Hello there", "Third"}
    assert by_prompt["What is a radix tree?"].output_len == 10  # 40 chars / 4
    assert by_prompt["What is a radix tree?"].prompt_len == round(21 / 4)
    assert by_prompt["Hello there"].output_len == 5
    assert by_prompt["Third"].output_len == 1

    fixed = sample_sharegpt_requests(path, num_prompts=2, fixed_output_len=33, seed=0)
    assert len(fixed) == 2 and all(r.output_len == 33 for r in fixed)
    assert sample_sharegpt_requests(path, 3, seed=5) == sample_sharegpt_requests(path, 3, seed=5)


def test_sharegpt_lengths_from_a_local_tokenizer(tmp_path: Path) -> None:
    from radixserve_tools.bench.serving_datasets import load_tokenizer

    class WordTokenizer:
        def encode(self, text: str, /, *, add_special_tokens: bool = True) -> list[int]:
            return list(range(len(text.split())))

        def decode(self, ids: list[int], /) -> str:
            return " ".join(map(str, ids))

    path = _write_sharegpt(tmp_path / "sg.json")
    reqs = sample_sharegpt_requests(path, 100, tokenizer=WordTokenizer(), seed=0)
    by_prompt = {r.prompt: r for r in reqs}
    assert by_prompt["What is a radix tree?"].prompt_len == 5
    assert by_prompt["Hello there"].output_len == 5  # "Hi! " x 5 -> five words
    with pytest.raises(OSError):
        load_tokenizer(str(tmp_path / "missing"))  # local only: no hub lookup for a bad path


def test_real_tokenizer_lengths_and_chat_prompts_from_token_ids(
    tiny_tokenizer: Any, fake: FakeServerState, tmp_path: Path
) -> None:
    from radixserve_tools.bench.serving_datasets import load_tokenizer

    tok_dir = tmp_path / "tok"
    tiny_tokenizer.save_pretrained(tok_dir)
    tokenizer = load_tokenizer(str(tok_dir))
    reqs = sample_sharegpt_requests(_write_sharegpt(tmp_path / "sg.json"), 100, tokenizer=tokenizer, seed=0)
    radix = next(r for r in reqs if r.prompt == "What is a radix tree?")
    assert radix.prompt_len == len(tiny_tokenizer.encode("What is a radix tree?", add_special_tokens=False))
    assert radix.output_len == len(tiny_tokenizer.encode("A" * 40, add_special_tokens=False))

    # Chat needs text: with a tokenizer the random token ids are decoded into the message.
    report = _run(
        base_url=fake.url("ok"),
        backend="chat",
        tokenizer=str(tok_dir),
        num_prompts=2,
        random_input_len=6,
        random_output_len=2,
        random_vocab_size=len(tiny_tokenizer),
    )
    assert report.metrics.completed == 2
    assert all(
        isinstance(b["messages"][0]["content"], str) and b["messages"][0]["content"] for b in fake.bodies
    )


# ---------------------------------------------------------------------------------------------
# Metric math
# ---------------------------------------------------------------------------------------------


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) == 0.0


def test_metrics_on_known_timings() -> None:
    results = [
        # ttft 0.1, 4 tokens, e2e 0.4 -> tpot 0.1; itl 0.1 x3
        RequestResult(True, prompt_tokens=10, output_tokens=4, ttft_s=0.1, e2e_s=0.4, itl_s=[0.1] * 3),
        # ttft 0.3, 3 tokens, e2e 0.7 -> tpot 0.2; itl 0.2 x2
        RequestResult(True, prompt_tokens=20, output_tokens=3, ttft_s=0.3, e2e_s=0.7, itl_s=[0.2, 0.2]),
        # one token: no TPOT
        RequestResult(True, prompt_tokens=30, output_tokens=1, ttft_s=0.2, e2e_s=0.2),
        RequestResult(False, error="HTTP 500: boom"),
    ]
    m = compute_metrics(results, duration_s=2.0)
    assert (m.total_requests, m.completed, m.failed) == (4, 3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (60, 8)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.input_throughput == pytest.approx(30.0)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(34.0)
    assert m.concurrency == pytest.approx((0.4 + 0.7 + 0.2) / 2.0)
    assert m.ttft.mean_ms == pytest.approx(200.0) and m.ttft.median_ms == pytest.approx(200.0)
    assert m.ttft.p99_ms == pytest.approx(200 + 100 * 0.98)  # between 200 and 300 at rank 1.98
    assert m.itl.mean_ms == pytest.approx((0.3 + 0.4) / 5 * 1000)
    assert m.itl.median_ms == pytest.approx(100.0)
    assert m.tpot.mean_ms == pytest.approx(150.0) and m.tpot.median_ms == pytest.approx(150.0)
    assert m.e2e.median_ms == pytest.approx(400.0)

    empty = compute_metrics([RequestResult(False, error="x")], duration_s=0.5)
    assert empty.completed == 0 and empty.ttft.mean_ms == 0.0 and empty.output_throughput == 0.0


def test_request_bodies() -> None:
    req = BenchRequest([101, 102, 103], 3, 9)
    body = request_body(ServingBenchConfig(), "m", req)
    assert body == {
        "model": "m",
        "prompt": [101, 102, 103],
        "max_tokens": 9,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    chat = request_body(ServingBenchConfig(backend="chat", ignore_eos=False), "m", BenchRequest("hi", 1, 2))
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "prompt" not in chat
    assert "ignore_eos" not in chat


# ---------------------------------------------------------------------------------------------
# End to end against the fake server
# ---------------------------------------------------------------------------------------------


def test_completions_run_end_to_end(fake: FakeServerState, tmp_path: Path) -> None:
    out = tmp_path / "out" / "report.json"
    report = _run(
        base_url=fake.url("ok") + "/v1/",  # an OpenAI-SDK-style base URL works too
        num_prompts=6,
        random_input_len=8,
        random_output_len=5,
        api_key="sekrit",
        output_file=str(out),
    )
    m = report.metrics
    assert report.model == "fake-model"  # from GET /v1/models
    assert (m.total_requests, m.completed, m.failed) == (6, 6, 0) and report.first_error is None
    assert (m.total_input_tokens, m.total_output_tokens) == (48, 30)
    assert m.request_throughput > 0 and m.output_throughput > 0 and m.duration_s > 0
    for r in report.results:
        assert 0 < r.ttft_s <= r.e2e_s
        assert len(r.itl_s) == 4 and r.tpot_s is not None and r.tpot_s > 0
        assert 0 <= r.start_s < m.duration_s  # sent during the run (--plot's time axis)
    assert m.ttft.mean_ms <= m.e2e.mean_ms and m.itl.median_ms > 0

    assert len(fake.bodies) == 6
    for body in fake.bodies:
        assert body["model"] == "fake-model" and body["stream"] is True and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True} and body["temperature"] == 0.0
        assert isinstance(body["prompt"], list) and len(body["prompt"]) == 8 and body["max_tokens"] == 5
    assert all(h["authorization"] == "Bearer sekrit" for h in fake.headers)

    saved = json.loads(out.read_text())
    assert saved["completed"] == 6 and saved["failed"] == 0 and saved["total_output_tokens"] == 30
    assert saved["mean_ttft_ms"] == pytest.approx(m.ttft.mean_ms)
    assert {"median_itl_ms", "p99_tpot_ms", "p99_e2e_ms", "request_throughput"} <= set(saved)
    assert saved["config"]["request_rate"] == "inf" and "api_key" not in saved["config"]


def test_poisson_arrivals_respect_max_concurrency(fake: FakeServerState) -> None:
    report = _run(
        base_url=fake.url("ok"),
        model="given",
        dataset="generated-shared-prefix",
        gsp_num_groups=2,
        gsp_prompts_per_group=3,
        gsp_system_prompt_len=6,
        gsp_question_len=2,
        gsp_output_len=4,
        request_rate=500.0,
        max_concurrency=2,
    )
    assert report.metrics.completed == 6 and report.metrics.failed == 0
    assert 1 <= fake.max_in_flight <= 2
    assert all(b["model"] == "given" and len(b["prompt"]) == 8 for b in fake.bodies)


def test_chat_backend_with_sharegpt(fake: FakeServerState, tmp_path: Path) -> None:
    path = _write_sharegpt(tmp_path / "sg.json")
    report = _run(
        base_url=fake.url("ok"), backend="chat", dataset="sharegpt", dataset_path=str(path), num_prompts=2
    )
    assert report.metrics.completed == 2 and report.metrics.failed == 0
    # The role-only opening delta is not a token: 3 content chunks -> 2 gaps.
    assert all(len(r.itl_s) == r.output_tokens - 1 for r in report.results)
    assert all(isinstance(b["messages"][0]["content"], str) for b in fake.bodies)

    with pytest.raises(ServingBenchError, match="needs text prompts"):
        _run(base_url=fake.url("ok"), backend="chat", num_prompts=1)


def test_stream_without_usage_falls_back_to_chunk_counts(fake: FakeServerState) -> None:
    report = _run(base_url=fake.url("nousage"), num_prompts=2, random_input_len=7, random_output_len=3)
    assert report.metrics.completed == 2
    assert report.metrics.total_output_tokens == 6 and report.metrics.total_input_tokens == 14


def test_http_500_and_refused_connections_count_as_failures(
    fake: FakeServerState, capsys: pytest.CaptureFixture[str]
) -> None:
    report = _run(base_url=fake.url("fail"), num_prompts=4, random_input_len=4, random_output_len=2)
    m = report.metrics
    assert (m.total_requests, m.completed, m.failed) == (4, 0, 4)
    assert report.first_error is not None and report.first_error.startswith("HTTP 500")
    assert m.request_throughput == 0.0 and m.ttft.mean_ms == 0.0
    assert "HTTP 500" in capsys.readouterr().err  # the first error is shown as it happens

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    refused = _run(base_url=dead, model="m", num_prompts=3, random_input_len=4, random_output_len=2)
    assert refused.metrics.failed == 3 and refused.first_error is not None
    assert "Connect" in refused.first_error


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def test_cli_parses_serving_and_offline_subcommands() -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["bench", "serving", "--port", "8000", "--backend", "chat", "--dataset", "generated-shared-prefix"]
        + ["--gsp-num-groups", "2", "--gsp-system-prompt-len", "64", "--request-rate", "4.5"]
        + ["--max-concurrency", "3", "--no-ignore-eos", "--api-key", "k", "--output-file", "o.json"]
    )
    assert args.bench_command == "serving" and args.func.__name__ == "_bench_serving"
    assert (args.backend, args.dataset, args.gsp_num_groups, args.gsp_system_prompt_len) == (
        "chat",
        "generated-shared-prefix",
        2,
        64,
    )
    assert (args.request_rate, args.max_concurrency, args.ignore_eos) == (4.5, 3, False)
    assert _serving_base_url(args) == "http://127.0.0.1:8000"

    defaults = parser.parse_args(["bench", "serving"])
    assert math.isinf(defaults.request_rate) and defaults.ignore_eos is True
    assert defaults.max_concurrency is None and defaults.temperature == 0.0
    assert _serving_base_url(defaults) == "http://127.0.0.1:30000"
    both = parser.parse_args(["bench", "serving", "--base-url", "http://h:1", "--host", "x"])
    with pytest.raises(ValueError, match="not both"):
        _serving_base_url(both)

    offline = parser.parse_args(["bench", "offline", "--workloads", "W2", "--dtypes", "bfloat16"])
    assert offline.func.__name__ == "_bench_offline" and offline.workloads == ["W2"]
    for bad in (
        ["bench"],
        ["bench", "serving", "--request-rate", "0"],
        ["bench", "serving", "--dataset", "x"],
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_cli_runs_and_writes_json(
    fake: FakeServerState, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    argv = ["bench", "serving", "--base-url", fake.url("ok"), "--num-prompts", "3"]
    argv += [
        "--random-input-len",
        "4",
        "--random-output-len",
        "3",
        "--disable-tqdm",
        "--output-file",
        str(out),
        "--plot",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Median TTFT (ms):" in printed
    assert json.loads(out.read_text())["completed"] == 3
    page = tmp_path / "r.html"
    assert f"wrote {page}" in printed and page.read_text().count("<svg") == 5
    assert "TTFT distribution" in page.read_text() and "requests in flight" in page.read_text()

    assert main(["bench", "serving", "--dataset", "sharegpt", "--disable-tqdm"]) == 2
    assert "--dataset-path" in capsys.readouterr().err
