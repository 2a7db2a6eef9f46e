"""Prefill/decode disaggregation end to end, all on 127.0.0.1: a prefill server, a decode server and
`sglang-router --pd-disaggregation` in front of them. Greedy fp32 outputs through the router equal
a single server's (native and OpenAI routes, streaming or not), and requests given up on either
side (a client hanging up while the K/V is on its way, an abort on the decode server, a prefill
server that never sends) leave both servers idle with their KV accounting intact."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.ports import free_port
from tests.server.conftest import LiveServer, finish, launch
from tests.server.router import chat_text, generated_ids, launch_router

SHARED_SERVER = True  # the single server the outputs are compared with
GREEDY = {"temperature": 0.0, "max_new_tokens": 8}


@dataclass
class PD:
    prefill: LiveServer
    decode: LiveServer
    bootstrap_port: int
    router: str

    @property
    def servers(self) -> tuple[LiveServer, LiveServer]:
        return self.prefill, self.decode


@pytest.fixture(scope="module")
def pd(tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    model = tiny_model_dir("llama")
    bootstrap_port = free_port()
    prefill = launch(
        model, tmp_path_factory.mktemp("prefill"),
        "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port),
    )  # fmt: skip
    decode = launch(model, tmp_path_factory.mktemp("decode"), "--disaggregation-mode", "decode")
    try:
        log = tmp_path_factory.mktemp("pd-router") / "router.log"
        pd_args = ["--pd-disaggregation", "--prefill", prefill.base_url, str(bootstrap_port),
                   "--decode", decode.base_url, "--policy", "round_robin"]  # fmt: skip
        with launch_router(pd_args, log, healthy_workers=2) as router:
            yield PD(prefill, decode, bootstrap_port, router)
    finally:
        finish(decode)
        finish(prefill)


def _native(base: str, prompt: list[int], stream: bool) -> list[int]:
    return generated_ids(base, prompt, stream, GREEDY)


def _chat(base: str, content: str, stream: bool) -> str:
    return chat_text(base, content, stream, max_tokens=8)


def _wait_until_sent(prefill: LiveServer) -> None:
    """Until the prefill server holds no finished prompt any more (each sent, dropped or failed)."""
    deadline = time.monotonic() + 60
    while _disaggregation(prefill)["waiting_for_claim"]:
        assert time.monotonic() < deadline, _disaggregation(prefill)
        time.sleep(0.05)


def _disaggregation(server: LiveServer) -> dict[str, Any]:
    stats: dict[str, Any] = server.server_info()["disaggregation"]
    return stats


def test_outputs_through_the_pd_router_equal_a_single_servers(pd: PD, server: LiveServer) -> None:
    before = _disaggregation(pd.prefill)["handoffs"]
    prompts = [[11 + i, 40 + 3 * i, 7, 90 + i, 5 * i + 1] * (1 + i % 3) for i in range(8)]
    jobs: list[tuple[str, Any, bool]] = [("native", p, i % 2 == 0) for i, p in enumerate(prompts)]
    jobs += [("chat", f"Question {i}: what comes next?", i % 2 == 0) for i in range(4)]

    def run(base: str, job: tuple[str, Any, bool]) -> Any:
        kind, prompt, stream = job
        return _native(base, prompt, stream) if kind == "native" else _chat(base, prompt, stream)

    with ThreadPoolExecutor(4) as pool:
        routed = list(pool.map(lambda job: run(pd.router, job), jobs))
    direct = [run(server.base_url, job) for job in jobs]
    assert routed == direct
    # A handoff is counted once its last send returns, which can be after the decode server has it.
    _wait_until_sent(pd.prefill)
    prefill, decode = _disaggregation(pd.prefill), _disaggregation(pd.decode)
    assert prefill["mode"] == "prefill" and decode["mode"] == "decode"
    assert prefill["handoffs"] - before == len(jobs)
    assert decode["handoffs"] >= len(jobs) and decode["bytes"] > 0
    for half in pd.servers:
        half.assert_idle_and_kv_intact()


def test_logprobs_through_the_pd_router_equal_a_single_servers(pd: PD, server: LiveServer) -> None:
    """The first token's logprob, alternatives and named ids come from the prefill server, the
    rest from the decode server: together they are one server's."""
    body = {"input_ids": [17, 3, 99, 42, 8, 61], "sampling_params": GREEDY, "return_logprob": True,
            "top_logprobs_num": 3, "token_ids_logprob": [5, 7]}  # fmt: skip
    routed = httpx.post(f"{pd.router}/generate", json=body, timeout=120)
    direct = httpx.post(f"{server.base_url}/generate", json=body, timeout=120)
    assert routed.status_code == direct.status_code == 200, (routed.text, direct.text)
    ours, theirs = routed.json(), direct.json()
    assert ours["output_ids"] == theirs["output_ids"]
    for key in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
        mine, ref = ours["meta_info"][key], theirs["meta_info"][key]
        assert len(mine) == len(ref) == len(ours["output_ids"]), key
        for got, want in zip(mine, ref, strict=True):
            entries = got if key != "output_token_logprobs" else [got]
            expected = want if key != "output_token_logprobs" else [want]
            assert [e[1] for e in entries] == [e[1] for e in expected], key  # the same token ids
            assert [e[0] for e in entries] == pytest.approx([e[0] for e in expected], abs=1e-4), key
    for half in pd.servers:
        half.assert_idle_and_kv_intact()


def test_structured_output_through_the_pd_router_equals_a_single_servers(pd: PD, server: LiveServer) -> None:
    """The prefill server samples the first token under the grammar; the decode server's own
    matcher (compiled while the K/V is on its way) takes that token and goes on from it."""
    params = {"temperature": 0.0, "max_new_tokens": 16, "regex": r"[a-c]{2,4}-[0-9]{3}"}
    prompts = [[7, 8, 9, 10], [31, 4, 15, 92, 65]]
    routed = [generated_ids(pd.router, p, stream=False, params=params) for p in prompts]
    direct = [generated_ids(server.base_url, p, stream=False, params=params) for p in prompts]
    assert routed == direct
    for half in pd.servers:
        half.assert_idle_and_kv_intact()


def test_the_halves_refuse_requests_that_skip_the_router(pd: PD) -> None:
    for half, mode in ((pd.prefill, "prefill"), (pd.decode, "decode")):
        reply = httpx.post(
            f"{half.base_url}/generate", json={"input_ids": [1, 2, 3], "sampling_params": GREEDY}
        )
        assert reply.status_code == 400, reply.text
        assert f"this is a {mode} server" in reply.json()["error"]["message"]
        half.assert_idle_and_kv_intact()


def _slow_down(server: LiveServer, seconds: float) -> None:
    reply = httpx.post(f"{server.base_url}/slow_down", json={"forward_sleep_time": seconds}, timeout=30)
    assert reply.status_code == 200, reply.text


def test_clients_hanging_up_while_the_kv_is_on_its_way_leak_nothing(pd: PD) -> None:
    # A slow prefill server keeps the decode side waiting for K/V when the clients hang up.
    aborted = pd.decode.server_info()["aborted_reqs"]
    before = _disaggregation(pd.prefill)
    sent = before["handoffs"] + before["dropped"]
    _slow_down(pd.prefill, 0.5)
    try:
        long = {**GREEDY, "max_new_tokens": 400, "ignore_eos": True}

        def hang_up(i: int) -> None:
            body = {"input_ids": [i, *[5, 6, 7, 8] * 20], "sampling_params": long, "stream": True}
            with (
                contextlib.suppress(httpx.TimeoutException),
                httpx.Client(base_url=pd.router, timeout=0.3) as client,
                client.stream("POST", "/generate", json=body) as r,
            ):
                for _ in r.iter_lines():
                    pass

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(hang_up, range(4)))
    finally:
        _slow_down(pd.prefill, 0.0)
    for half in pd.servers:
        half.assert_idle_and_kv_intact()
    # The prefill side dropped what nobody claimed any more, and nothing waits on either side.
    _wait_until_sent(pd.prefill)
    assert _disaggregation(pd.decode)["awaiting_kv"] == 0
    # Every hang-up reached the decode server as an abort (while it waited for K/V, or after), and
    # the prefill server sent or dropped each prompt.
    assert pd.decode.server_info()["aborted_reqs"] - aborted == 4
    after = _disaggregation(pd.prefill)
    assert after["handoffs"] + after["dropped"] - sent == 4
    # And both still serve.
    assert _native(pd.router, [9, 8, 7], stream=False)


def test_an_abort_on_the_decode_server_frees_what_it_reserved(pd: PD) -> None:
    # Sent to the decode server alone: the prefill server never computes it, so it waits for K/V.
    bootstrap = {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": pd.bootstrap_port,
        "bootstrap_room": 2**62 + 5,
    }
    body = {"input_ids": [4, 4, 4, 4], "sampling_params": GREEDY, "rid": "orphan", **bootstrap}
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(httpx.post, f"{pd.decode.base_url}/generate", json=body, timeout=120)
        deadline = time.monotonic() + 60
        while _disaggregation(pd.decode)["awaiting_kv"] == 0:
            assert not waiting.done(), waiting.result().text
            assert time.monotonic() < deadline
            time.sleep(0.05)
        aborted = httpx.post(f"{pd.decode.base_url}/abort_request", json={"rid": "orphan"}, timeout=30)
        assert aborted.status_code == 200, aborted.text
        reply = waiting.result()
    assert reply.json()["meta_info"]["finish_reason"]["type"] == "abort", reply.text
    # The prefill server computes the same room later: nobody claims it, so it is dropped.
    dropped = _disaggregation(pd.prefill)["dropped"]
    reply = httpx.post(f"{pd.prefill.base_url}/generate", json={**body, "rid": "late"}, timeout=120)
    assert reply.status_code == 200, reply.text
    deadline = time.monotonic() + 60
    while _disaggregation(pd.prefill)["dropped"] == dropped:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for half in pd.servers:
        half.assert_idle_and_kv_intact()
