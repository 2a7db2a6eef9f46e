"""Grammar-constrained decoding with the random tiny model: outputs always parse."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from radixserve.config.server_args import ServerArgs
from radixserve.protocol.messages import GenerateRequest, ReqOutput
from radixserve.protocol.sampling_params import SamplingParams
from radixserve.scheduler.grammar import CompileResult
from radixserve.scheduler.process import build_scheduler
from tests.engine.oracle import GREEDY

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 999},
                "ok": {"type": "boolean"},
            },
            "required": ["id", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "tags", "owner"],
    "additionalProperties": False,
}
# Each line: a greeting, then one to three digits.
EBNF = 'root ::= ("hi" | "hello") " " [0-9] [0-9]? [0-9]?'
EBNF_PATTERN = r"(hi|hello) [0-9]{1,3}"


@pytest.fixture
def engine(tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Any]) -> Any:
    return make_engine(tiny_model_dir("llama"), max_total_tokens=8192)


def test_json_schema_outputs_parse_and_validate_for_20_seeds(engine: Any) -> None:
    params = [
        {"temperature": 1.0, "seed": seed, "max_new_tokens": 256, "json_schema": json.dumps(SCHEMA)}
        for seed in range(20)
    ]
    results = engine.generate(input_ids=[[5, 6, 7 + i] for i in range(20)], sampling_params=params)
    for result in results:
        assert result["meta_info"]["finish_reason"]["type"] == "stop", result
        jsonschema.validate(json.loads(result["text"]), SCHEMA)


def test_regex_and_ebnf_outputs_match(engine: Any) -> None:
    regex = r"[a-c]{2,4}-[0-9]{3}"
    results = engine.generate(
        input_ids=[[9, 8, 7]] * 8,
        sampling_params=[
            {"temperature": 1.0, "seed": s, "max_new_tokens": 64, "regex": regex} for s in range(4)
        ]
        + [{"temperature": 1.0, "seed": s, "max_new_tokens": 64, "ebnf": EBNF} for s in range(4)],
    )
    for result in results[:4]:
        assert re.fullmatch(regex, result["text"]), result["text"]
    for result in results[4:]:
        assert re.fullmatch(EBNF_PATTERN, result["text"]), result["text"]


def test_json_object_and_invalid_grammars(engine: Any) -> None:
    from radixserve.protocol.sampling_params import ANY_JSON

    any_json = engine.generate(
        input_ids=[3, 4],
        sampling_params={"temperature": 1.0, "seed": 1, "max_new_tokens": 200, "json_schema": ANY_JSON},
    )
    if any_json["meta_info"]["finish_reason"]["type"] == "stop":
        json.loads(any_json["text"])
    for bad in (
        {"json_schema": "{not json"},
        {"json_schema": '{"type": "no-such-type"}'},
        {"regex": "(unclosed"},
    ):
        result = engine.generate(input_ids=[3, 4], sampling_params={**GREEDY, "max_new_tokens": 4, **bad})
        finish = result["meta_info"]["finish_reason"]
        assert finish["type"] == "abort" and finish["message"].startswith("invalid "), finish
    # The same bad grammar again is answered from the cache, and the engine still serves.
    ok = engine.generate(input_ids=[3, 4], sampling_params={**GREEDY, "max_new_tokens": 2})
    assert len(ok["output_ids"]) == 2


def test_a_slow_grammar_does_not_hold_up_other_requests(tiny_model_dir: Callable[[str], Path]) -> None:
    scheduler = build_scheduler(
        ServerArgs(model_path=str(tiny_model_dir("llama")), dtype="float32", max_total_tokens=1024)
    )
    backend = scheduler.grammar_queue.backend
    release = threading.Event()
    real_compile = backend._compile

    def slow_compile(kind: str, spec: str) -> Any:
        release.wait(timeout=60)
        return real_compile(kind, spec)

    backend._compile = slow_compile  # type: ignore[method-assign]
    finished: dict[str, ReqOutput] = {}

    def run(messages: list[Any]) -> None:
        for out in messages:
            if isinstance(out, ReqOutput) and out.finished_reason is not None:
                finished[out.rid] = out

    run(
        scheduler.handle(
            GenerateRequest(
                "slow", [5, 6], SamplingParams.from_dict({**GREEDY, "max_new_tokens": 3, "regex": "[ab]{3}"})
            )
        )
    )
    run(
        scheduler.handle(
            GenerateRequest("plain", [7, 8], SamplingParams.from_dict({**GREEDY, "max_new_tokens": 3}))
        )
    )
    while "plain" not in finished:
        run(scheduler.step())
    # The unconstrained request, submitted later, finished while the grammar still compiles.
    assert "slow" not in finished and scheduler.grammar_queue.pending
    # Abort works in the grammar queue too; a second slow request is released and completes.
    run(scheduler.abort("slow"))
    assert finished["slow"].finished_reason is not None and finished["slow"].finished_reason.type == "abort"
    run(
        scheduler.handle(
            GenerateRequest(
                "slow2", [5, 6], SamplingParams.from_dict({**GREEDY, "max_new_tokens": 3, "regex": "[ab]{3}"})
            )
        )
    )
    release.set()
    while "slow2" not in finished:
        run(scheduler.step())
    assert isinstance(scheduler.grammar_queue.backend.compile(("regex", "[ab]{3}")).result(), CompileResult)
    scheduler.check_kv_invariant()
    scheduler.grammar_queue.shutdown()


CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}
TAGGED = re.compile(r"<fn=weather>(.*)</fn>", re.DOTALL)


def test_structural_tags_wrap_schema_json_in_their_tags(engine: Any) -> None:
    # xgrammar's form: exactly one tag around its content. (JSON-schema content inside a tag admits
    # free whitespace, which a random model emits forever; a regex for compact JSON does not.)
    exact = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<fn=weather>",
            "content": {"type": "regex", "pattern": '\\{"city":"(Paris|Oslo)"\\}'},
            "end": "</fn>",
        },
    }
    params = [
        {"temperature": 1.0, "seed": seed, "max_new_tokens": 64, "structural_tag": json.dumps(exact)}
        for seed in range(5)
    ]
    for result in engine.generate(input_ids=[[5, 6, 7 + i] for i in range(5)], sampling_params=params):
        assert result["meta_info"]["finish_reason"]["type"] == "stop", result
        match = TAGGED.fullmatch(result["text"])
        assert match is not None, result["text"]
        jsonschema.validate(json.loads(match.group(1)), CITY)


def test_sglang_structural_tag_form_is_translated() -> None:
    import xgrammar as xgr

    from radixserve.scheduler.grammar import structural_tag_spec

    structure = {"begin": "<fn=weather>", "schema": CITY, "end": "</fn>"}
    legacy = {"type": "structural_tag", "structures": [structure], "triggers": ["<fn="]}
    translated = json.loads(structural_tag_spec(json.dumps(legacy)))
    assert translated["format"]["type"] == "triggered_tags"
    assert translated["format"]["tags"][0]["content"]["json_schema"] == CITY
    info = xgr.TokenizerInfo([f"t{i}" for i in range(16)])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_structural_tag(json.dumps(translated)))
    assert matcher.accept_string('free text <fn=weather>{"city": "Oslo"}</fn> more')
    assert not xgr.GrammarMatcher(
        xgr.GrammarCompiler(info).compile_structural_tag(json.dumps(translated))
    ).accept_string('<fn=weather>{"city": "Rome"}</fn>')
