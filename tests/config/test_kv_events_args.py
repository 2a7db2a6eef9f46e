"""--kv-events-config: the JSON object is checked at startup, with vLLM's and SGLang's keys."""

from __future__ import annotations

import argparse
import json

import pytest

from radixserve.config.kv_events_args import DEFAULT_ENDPOINT, KVEventsConfig, parse_kv_events_config
from radixserve.config.server_args import InvalidArgumentError, ServerArgs


def parse(value: object) -> KVEventsConfig | None:
    return parse_kv_events_config(json.dumps(value), InvalidArgumentError)


def test_defaults_publish_on_loopback() -> None:
    config = parse({"publisher": "zmq"})
    assert config == KVEventsConfig() and config.endpoint == DEFAULT_ENDPOINT == "tcp://127.0.0.1:5557"
    assert parse({}) == KVEventsConfig()


def test_vllm_s_and_sglang_s_keys_are_taken() -> None:
    config = parse({
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:6000",
        "replay_endpoint": "tcp://*:6001", "buffer_steps": 5, "hwm": 7, "max_queue_size": 9, "topic": "t",
    })  # fmt: skip
    assert config == KVEventsConfig("zmq", True, "tcp://*:6000", "tcp://*:6001", 5, 7, 9, "t")


def test_switched_off_publishes_nothing() -> None:
    assert parse_kv_events_config(None, InvalidArgumentError) is None
    assert parse({"publisher": "null"}) is None
    assert parse({"enable_kv_cache_events": False}) is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "is not JSON"),
        ([1], "must be a JSON object"),
        ({"publisher": "kafka"}, "publisher must be 'zmq' or 'null'"),
        ({"endpointt": "tcp://*:1"}, "unknown keys \\['endpointt'\\]"),
        ({"hwm": "many"}, "'hwm' must be an integer"),
        ({"buffer_steps": True}, "'buffer_steps' must be an integer"),
        ({"buffer_steps": 0}, "buffer_steps must be >= 1"),
        ({"endpoint": "http://x:1"}, "endpoint must be a tcp://"),
    ],
)
def test_bad_configs_are_refused_with_the_reason(value: object, message: str) -> None:
    text = value if isinstance(value, str) else json.dumps(value)
    with pytest.raises(InvalidArgumentError, match=message):
        parse_kv_events_config(text, InvalidArgumentError)


def test_the_flag_parses_and_needs_the_radix_cache() -> None:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(
        parser.parse_args(["--model-path", "m", "--kv-events-config", '{"publisher": "zmq"}'])
    )
    assert args.kv_events_config == '{"publisher": "zmq"}'
    with pytest.raises(InvalidArgumentError, match="needs the radix cache"):
        ServerArgs(model_path="m", kv_events_config='{"publisher": "zmq"}', disable_radix_cache=True)
