"""Multi-LoRA serving against transformers + peft on the same weights (fp32 greedy): adapters of
different ranks and targets mixed with the base model in one batch, a pool smaller than the
adapters in use, cache separation by adapter, loading and unloading at run time, and refusals."""

from __future__ import annotations

import queue
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from radixserve.protocol.sampling_params import InvalidRequestError
from radixserve.runtime.engine import Engine
from tests.engine.oracle import GREEDY, GreedyOracle, final_output, random_prompts
from tests.lora_adapters import ATTENTION, make_adapter

MAX_NEW = 10


@pytest.fixture(scope="module")
def adapters(lora_adapters: dict[str, Path]) -> dict[str, Path]:
    return lora_adapters


@pytest.fixture
def lora_engine(
    tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Engine]
) -> Callable[..., Engine]:
    """Engines of the tiny llama with the given flags (checked idle and leak-free at the end)."""
    return lambda **flags: make_engine(tiny_model_dir("llama"), **flags)


@pytest.fixture(scope="module")
def peft_oracle(
    tiny_model_dir: Callable[[str], Path], adapters: dict[str, Path]
) -> Callable[[str | None], GreedyOracle]:
    cache: dict[str | None, GreedyOracle] = {}

    def get(name: str | None) -> GreedyOracle:
        if name not in cache:
            cache[name] = GreedyOracle(tiny_model_dir("llama"), None if name is None else adapters[name])
        return cache[name]

    return get


def lora_paths(adapters: dict[str, Path], names: list[str]) -> list[str]:
    return [f"{name}={adapters[name]}" for name in names]


def assert_like_peft(
    engine: Engine,
    oracle: Callable[[str | None], GreedyOracle],
    prompts: list[list[int]],
    names: list[str | None],
) -> None:
    results = engine.generate(
        input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": MAX_NEW}, lora_path=names
    )
    assert isinstance(results, list)
    changed = 0
    for i, (prompt, name, result) in enumerate(zip(prompts, names, results, strict=True)):
        assert result["output_ids"] == oracle(name).continue_(prompt, MAX_NEW), (
            f"prompt {i} with adapter {name}"
        )
        changed += name is not None and result["output_ids"] != oracle(None).continue_(prompt, MAX_NEW)
    # The adapters matter: most of their outputs differ from the base model's.
    assert changed >= sum(n is not None for n in names) // 2


@pytest.mark.parametrize("stacked_rows", [None, "0", "100000"], ids=["by-size", "segmented", "stacked"])
def test_three_adapters_and_the_base_in_one_batch(
    stacked_rows: str | None,
    lora_engine: Callable[..., Engine],
    adapters: dict[str, Path],
    peft_oracle: Callable[[str | None], GreedyOracle],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both ways of applying the deltas (layers/lora.py), forced, and chosen by size."""
    if stacked_rows is not None:
        monkeypatch.setenv("RADIXSERVE_LORA_STACKED_MAX_ROWS", stacked_rows)
    engine = lora_engine(lora_paths=lora_paths(adapters, ["a", "b", "c"]), chunked_prefill_size=16)
    prompts = random_prompts(12, seed=50)
    names: list[str | None] = [None, "a", "b", "c"] * 3
    assert_like_peft(engine, peft_oracle, prompts, names)
    slots = {a["name"]: a["slot"] for a in engine.get_stats()["lora_adapters"]}
    assert sorted(slots) == ["a", "b", "c"] and None not in slots.values()


def test_more_adapters_than_slots_take_turns(
    lora_engine: Callable[..., Engine],
    adapters: dict[str, Path],
    peft_oracle: Callable[[str | None], GreedyOracle],
) -> None:
    """Two slots, three adapters in one call: admission keeps a batch to two adapters, and slots
    are refilled (least recently used first) only from adapters no running request uses."""
    engine = lora_engine(lora_paths=lora_paths(adapters, ["a", "b", "c"]), max_loras_per_batch=2)
    prompts = random_prompts(9, seed=51)
    names: list[str | None] = ["a", "b", "c", None, "c", "b", "a", "c", None]
    assert_like_peft(engine, peft_oracle, prompts, names)
    held = [a["slot"] for a in engine.get_stats()["lora_adapters"] if a["slot"] is not None]
    assert sorted(held) == [0, 1]


def test_adapters_never_share_cached_prefixes(
    lora_engine: Callable[..., Engine],
    adapters: dict[str, Path],
    peft_oracle: Callable[[str | None], GreedyOracle],
) -> None:
    engine = lora_engine(lora_paths=lora_paths(adapters, ["a", "b"]))
    prompt = random_prompts(1, [40], seed=52)[0]
    params = {**GREEDY, "max_new_tokens": MAX_NEW}

    def run(name: str | None) -> dict[str, Any]:
        result = engine.generate(input_ids=prompt, sampling_params=params, lora_path=name)
        assert isinstance(result, dict)
        assert result["output_ids"] == peft_oracle(name).continue_(prompt, MAX_NEW)
        return result

    assert run("a")["meta_info"]["cached_tokens"] == 0
    assert run("b")["meta_info"]["cached_tokens"] == 0  # same tokens, another adapter's K/V
    assert run(None)["meta_info"]["cached_tokens"] == 0  # nor the base model's
    assert run("a")["meta_info"]["cached_tokens"] > 0  # its own K/V again


def test_load_and_unload_at_run_time(
    lora_engine: Callable[..., Engine],
    adapters: dict[str, Path],
    peft_oracle: Callable[[str | None], GreedyOracle],
) -> None:
    engine = lora_engine(enable_lora=True, max_lora_rank=8, lora_target_modules=["all"])
    prompt = random_prompts(1, [20], seed=53)[0]
    assert engine.load_lora_adapter("b", str(adapters["b"])) == {"b": str(adapters["b"])}
    assert_like_peft(engine, peft_oracle, [prompt, prompt], ["b", None])
    # Unloading is refused while a request uses the adapter, and works once it is done.
    box: queue.Queue[Any] = queue.Queue()
    long = {**GREEDY, "max_new_tokens": 2000}
    engine.submit(engine.requests.build(prompt, long, rid="long", lora_path="b"), box.put)
    box.get(timeout=60)
    with pytest.raises(InvalidRequestError, match="in use"):
        engine.unload_lora_adapter("b")
    engine.abort("long", exact=True)
    assert final_output(box).finished_reason.type == "abort"
    assert engine.unload_lora_adapter("b") == {}
    with pytest.raises(InvalidRequestError, match="'b' is not loaded"):
        engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="b")
    # Loaded again under another name, the same adapter finds its own cached K/V.
    engine.load_lora_adapter("again", str(adapters["b"]))
    again = engine.generate(
        input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": MAX_NEW}, lora_path="again"
    )
    assert isinstance(again, dict)
    assert again["output_ids"] == peft_oracle("b").continue_(prompt, MAX_NEW)
    assert again["meta_info"]["cached_tokens"] > 0


def test_bad_adapters_are_refused(
    lora_engine: Callable[..., Engine], adapters: dict[str, Path], tmp_path: Path
) -> None:
    engine = lora_engine(enable_lora=True, max_lora_rank=4, lora_target_modules=["all"])
    with pytest.raises(InvalidRequestError, match="above --max-lora-rank 4"):
        engine.load_lora_adapter("b", str(adapters["b"]))  # rank 8
    # An adapter of another base model: the same architecture, a narrower hidden size.
    from transformers import LlamaConfig, LlamaForCausalLM

    narrow = LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    LlamaForCausalLM(narrow).save_pretrained(tmp_path / "narrow")
    other = make_adapter(tmp_path / "narrow", tmp_path / "narrow-lora", 2, 4, ATTENTION, False, 4)
    with pytest.raises(InvalidRequestError, match="does not fit this base model"):
        engine.load_lora_adapter("other", str(other))
    with pytest.raises(InvalidRequestError, match="not a directory"):
        engine.load_lora_adapter("missing", str(tmp_path / "missing"))
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "adapter_config.json").write_text(
        '{"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}'
    )
    (tmp_path / "pickled" / "adapter_model.bin").write_bytes(b"not read")
    with pytest.raises(InvalidRequestError, match="never unpickled"):
        engine.load_lora_adapter("pickled", str(tmp_path / "pickled"))
    assert engine.lora_adapters == {}


@pytest.mark.parametrize(
    "flags",
    [
        {"tp_size": 2},
        {"pp_size": 2},
        {"enable_overlap_schedule": True},
        {"max_total_tokens": 160, "schedule_conservativeness": 0.05},
    ],
    ids=["tp2", "pp2", "overlap", "retraction"],
)
def test_adapters_with_ranks_overlap_and_retraction(
    flags: dict[str, Any],
    lora_engine: Callable[..., Engine],
    adapters: dict[str, Path],
    peft_oracle: Callable[[str | None], GreedyOracle],
) -> None:
    """Tensor parallelism splits B of q/k/v/gate/up and A of o/down (whose x A^T is summed over the
    ranks); pipeline stages each hold their own layers' adapter weights; the overlap schedule
    publishes while the next batch (and its slots) is prepared; a retracted request comes back
    with its adapter."""
    engine = lora_engine(lora_paths=lora_paths(adapters, ["a", "b", "c"]), **flags)
    prompts = random_prompts(8, seed=54)
    assert_like_peft(engine, peft_oracle, prompts, [None, "a", "b", "c"] * 2)
    if "max_total_tokens" in flags:
        assert engine.get_stats()["retracted_reqs"] > 0
