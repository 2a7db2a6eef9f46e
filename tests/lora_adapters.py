"""Random-weight PEFT LoRA adapters for the tiny test models (tests/conftest.py's lora_adapters):
the oracle for them is transformers + peft on the same weights."""

from __future__ import annotations

from pathlib import Path

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name: (rank, alpha, target modules, rsLoRA, seed)
ADAPTERS: dict[str, tuple[int, int, list[str], bool, int]] = {
    "a": (4, 8, ATTENTION + MLP, False, 1),
    "b": (8, 16, ATTENTION, False, 2),
    "c": (2, 4, MLP, True, 3),
}


def make_adapter(
    model_dir: Path, out: Path, rank: int, alpha: int, targets: list[str], rslora: bool, seed: int
) -> Path:
    """A random-weight PEFT adapter (both A and B random, so that it changes the outputs)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False
    )
    get_peft_model(model, config).save_pretrained(out)
    return out
