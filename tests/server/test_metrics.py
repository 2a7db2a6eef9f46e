"""GET /metrics (Prometheus) and GET /get_load."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# Only requests, no state changes: the session's shared server (tests/server/conftest.py).
SHARED_SERVER = True


def samples(text: str) -> dict[str, float]:
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_count_what_was_sent(tiny_model_dir: Callable[[str], Path], start_server: Any) -> None:
    live = start_server(tiny_model_dir("llama"), "--enable-metrics")
    prompts = [[5, 6, 7], [5, 6, 7, 8], [9, 10, 11, 12, 13]]
    with live.client() as client:
        idle = {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
        assert client.get("/get_load").json() == [idle]  # one entry per data-parallel rank
        for ids in prompts:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
            assert client.post("/generate", json=body).status_code == 200
        response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    values = samples(response.text)
    assert values["radixserve:num_requests_total"] == 3
    assert values["radixserve:prompt_tokens_total"] == sum(len(p) for p in prompts)
    assert values["radixserve:generation_tokens_total"] == 12
    assert values["radixserve:e2e_request_latency_seconds_count"] == 3
    assert values["radixserve:time_to_first_token_seconds_count"] == 3
    # One gap per token after the first, per request.
    assert values["radixserve:inter_token_latency_seconds_count"] == 9
    assert values["radixserve:num_running_reqs"] == 0 and values["radixserve:num_queue_reqs"] == 0
    assert 0.0 <= values["radixserve:cache_hit_rate"] <= 1.0


def test_metrics_are_off_by_default(server: Any) -> None:
    with server.client() as client:
        off = client.get("/metrics")
        assert off.status_code == 404 and "--enable-metrics" in off.json()["error"]["message"]


def test_speculative_decoding_over_http_streams_and_reports_acceptance(
    tiny_model_dir: Callable[[str], Path], start_server: Any
) -> None:
    """A live server with --speculative-algorithm NGRAM: a streamed repeat of an earlier request
    (drafted from the shared n-gram index) gives the same tokens as the first, non-streamed call,
    and /metrics and /get_server_info report the acceptance."""
    flags = ("--enable-metrics", "--speculative-algorithm", "NGRAM", "--disable-speculative-adaptive")
    live = start_server(tiny_model_dir("llama"), *flags)
    body = {"input_ids": list(range(40, 60)), "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
    with live.client() as client:
        first = client.post("/generate", json=body).json()
        streamed: list[int] = []
        with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    streamed = json.loads(line[len("data: ") :])["output_ids"]
        values = samples(client.get("/metrics").text)
    assert streamed == first["output_ids"] and len(streamed) == 24
    info = live.server_info()
    assert info["speculative_algorithm"] == "NGRAM"
    assert info["spec_accepted_tokens"] > 0 and info["avg_spec_accept_length"] > 1.0
    assert values["radixserve:spec_accept_length"] == info["avg_spec_accept_length"]
    live.assert_idle_and_kv_intact()
