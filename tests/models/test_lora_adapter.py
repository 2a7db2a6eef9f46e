"""Reading PEFT adapters (models/lora_adapter.py): what is read, and what is refused before any
weight is used."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from radixserve.models.config import ModelConfig
from radixserve.models.lora_adapter import LoraAdapterError, load_lora_adapter
from radixserve.models.source import load_model_config, resolve_model_source


@pytest.fixture
def config(tiny_model_dir: Callable[[str], Path]) -> ModelConfig:
    return load_model_config(resolve_model_source(str(tiny_model_dir("llama"))))


def write_adapter(directory: Path, config: dict[str, object], tensors: dict[str, torch.Tensor]) -> Path:
    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


KEY = "base_model.model.model.layers.{layer}.self_attn.q_proj.lora_{half}.weight"


def q_proj(layer: int, rank: int, hidden: int) -> dict[str, torch.Tensor]:
    return {
        KEY.format(layer=layer, half="A"): torch.randn(rank, hidden),
        KEY.format(layer=layer, half="B"): torch.randn(hidden, rank),
    }


def test_a_peft_adapter_is_read_with_its_scaling(config: ModelConfig, lora_adapters: dict[str, Path]) -> None:
    adapter = load_lora_adapter("c", str(lora_adapters["c"]), config)
    assert adapter.rank == 2 and adapter.scaling == pytest.approx(4 / 2**0.5)  # rsLoRA: alpha / sqrt(r)
    assert adapter.target_modules == {"gate_proj", "up_proj", "down_proj"}
    assert len(adapter.weights) == 3 * config.num_hidden_layers
    assert len(adapter.fingerprint) == 64


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "bias 'all'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": "all-linear"}, "as one string"),
    ],
)
def test_what_is_not_served_is_refused(
    config: ModelConfig, tmp_path: Path, extra: dict[str, object], message: str
) -> None:
    fields = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], **extra}
    path = write_adapter(tmp_path / "a", fields, q_proj(0, 2, config.hidden_size))
    with pytest.raises(LoraAdapterError, match=message):
        load_lora_adapter("a", str(path), config)


def test_weights_that_do_not_fit_are_refused(config: ModelConfig, tmp_path: Path) -> None:
    fields = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    too_deep = write_adapter(
        tmp_path / "deep", fields, q_proj(config.num_hidden_layers, 2, config.hidden_size)
    )
    with pytest.raises(LoraAdapterError, match="the model has fewer"):
        load_lora_adapter("deep", str(too_deep), config)
    head = {**q_proj(0, 2, config.hidden_size), "base_model.model.lm_head.lora_A.weight": torch.zeros(2, 4)}
    with pytest.raises(LoraAdapterError, match="is not a LoRA weight"):
        load_lora_adapter("head", str(write_adapter(tmp_path / "head", fields, head)), config)
    wrong_rank = write_adapter(tmp_path / "rank", {**fields, "r": 3}, q_proj(0, 2, config.hidden_size))
    with pytest.raises(LoraAdapterError, match="does not fit this base model"):
        load_lora_adapter("rank", str(wrong_rank), config)
    with pytest.raises(LoraAdapterError, match="outside --lora-target-modules"):
        load_lora_adapter("q", str(write_adapter(tmp_path / "q", fields, q_proj(0, 2, config.hidden_size))),
                          config, allowed_modules=frozenset({"v_proj"}))  # fmt: skip
