"""Weights changed in place (update_weights_from_tensor), read back by checkpoint name, and memory
released and resumed, on fp32 and on the bf16 CPU path whose linear weights are stored packed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from radixserve.protocol.sampling_params import InvalidRequestError
from radixserve.runtime.engine import Engine
from tests.conftest import build_tiny_model
from tests.engine.oracle import GreedyOracle

PROMPT = [5, 6, 7, 8, 9]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


def greedy(engine: Engine) -> list[int]:
    out = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert isinstance(out, dict)
    ids: list[int] = out["output_ids"]
    return ids


def checkpoint(path: Path) -> list[tuple[str, torch.Tensor]]:
    return list(load_file(path / "model.safetensors").items())


@pytest.fixture(scope="module")
def other_model(tiny_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tiny_tokenizer, tmp_path_factory.mktemp("other-llama"), seed=1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_update_weights_from_tensor_serves_the_new_weights(
    dtype: str,
    tiny_model_dir: Callable[[str], Path],
    other_model: Path,
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine(tiny_model_dir("llama"), dtype=dtype)
    before = greedy(engine)
    assert engine.update_weights_from_tensor(checkpoint(other_model)) > 0
    after = greedy(engine)
    if dtype == "float32":
        assert after == GreedyOracle(other_model).continue_(PROMPT, 8) != before
    else:
        # bf16: the same as an engine that loaded the other checkpoint from disk.
        assert after == greedy(make_engine(other_model, dtype=dtype)) != before


def test_partial_updates_and_reads_by_checkpoint_name_on_packed_weights(
    tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(tiny_model_dir("llama"), dtype="bfloat16")
    name = "model.layers.0.self_attn.k_proj.weight"  # the middle shard of the stacked q/k/v layer
    original = dict(checkpoint(tiny_model_dir("llama")))[name]
    read = torch.tensor(engine.get_weights_by_name(name, truncate_size=10**9)).view(original.shape)
    torch.testing.assert_close(read, original.to(torch.bfloat16).float())

    new = torch.randn_like(original)
    engine.update_weights_from_tensor([(name, new)])
    read = torch.tensor(engine.get_weights_by_name(name, truncate_size=10**9)).view(original.shape)
    torch.testing.assert_close(read, new.to(torch.bfloat16).float())
    # The q rows of the same stacked layer are untouched.
    q_name = "model.layers.0.self_attn.q_proj.weight"
    q_original = dict(checkpoint(tiny_model_dir("llama")))[q_name]
    assert (
        engine.get_weights_by_name(q_name, 6) == q_original.flatten()[:6].to(torch.bfloat16).float().tolist()
    )


def test_a_failed_update_changes_nothing(
    tiny_model_dir: Callable[[str], Path], other_model: Path, make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(tiny_model_dir("llama"))
    before = greedy(engine)
    good = checkpoint(other_model)
    wrong_shape = [*good[:3], ("model.norm.weight", torch.ones(3))]
    with pytest.raises(InvalidRequestError, match="expected shape"):
        engine.update_weights_from_tensor(wrong_shape)
    with pytest.raises(InvalidRequestError, match="no place"):
        engine.update_weights_from_tensor([*good[:3], ("model.layers.9.mlp.up_proj.weight", torch.ones(1))])
    assert greedy(engine) == before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_release_and_resume_memory_give_identical_outputs(
    dtype: str, tiny_model_dir: Callable[[str], Path], make_engine: Callable[..., Engine]
) -> None:
    engine = make_engine(tiny_model_dir("llama"), dtype=dtype)
    before = greedy(engine)
    resident = engine.get_stats()["resident_bytes"]
    assert resident["weights"] > 0 and resident["kv_cache"] > 0
    assert engine.release_memory_occupation() == ["kv_cache", "weights"]
    assert engine.get_stats()["resident_bytes"] == {"weights": 0, "kv_cache": 0}
    refused = engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
    assert isinstance(refused, dict)
    finish = refused["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and "resume_memory_occupation" in finish["message"]
    with pytest.raises(InvalidRequestError, match="released"):
        engine.get_weights_by_name("model.norm.weight")
    assert engine.resume_memory_occupation(["weights"]) == ["kv_cache"]
    assert engine.resume_memory_occupation() == []
    assert engine.get_stats()["resident_bytes"] == resident
    assert greedy(engine) == before

    assert engine.release_memory_occupation(["kv_cache"]) == ["kv_cache"]
    engine.resume_memory_occupation(["kv_cache"])
    assert greedy(engine) == before
    with pytest.raises(InvalidRequestError, match="tags must be"):
        engine.release_memory_occupation(["gpu"])
