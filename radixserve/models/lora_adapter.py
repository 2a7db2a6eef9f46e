"""Reading a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for a model of the
Llama family, checked against the base model's shapes before anything is served with it.

Supported: plain LoRA on q/k/v/o/gate/up/down of any layers, any rank, lora_alpha scaling (or
alpha / sqrt(r) with use_rslora). Refused with a message naming the reason: DoRA, biases, extra
trained modules (modules_to_save, embeddings, the head), per-module rank or alpha patterns, and
pickled weights (adapter_model.bin: never unpickled; convert it to safetensors).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])\.weight$"
)


class LoraAdapterError(ValueError):
    """The adapter cannot be served over this model; the message says why."""


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    target_modules: frozenset[str]
    # (layer index, module name) -> (A [rank, in], B [out, rank]), on the CPU as stored.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # The weights file's SHA-256: the adapter's identity wherever its K/V is kept or named (the
    # radix cache's namespace, the storage tier's files), the same after a restart.
    fingerprint: str


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection an adapter may target."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    return {
        "q_proj": (hidden, q_size),
        "k_proj": (hidden, kv_size),
        "v_proj": (hidden, kv_size),
        "o_proj": (q_size, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def read_adapter_config(directory: Path) -> tuple[int, float, frozenset[str]]:
    """The adapter's rank, scaling and target modules, or LoraAdapterError for what is not served."""
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except OSError as exc:
        raise LoraAdapterError(f"no readable {CONFIG_FILE} in {directory}: {exc}") from exc
    except ValueError as exc:
        raise LoraAdapterError(f"{CONFIG_FILE} in {directory} is not JSON: {exc}") from exc
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"{directory} is not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    unsupported = [
        what
        for what, used in (
            ("DoRA (use_dora)", config.get("use_dora")),
            (f"bias {config.get('bias')!r}", config.get("bias", "none") != "none"),
            ("modules_to_save", config.get("modules_to_save")),
            ("rank_pattern", config.get("rank_pattern")),
            ("alpha_pattern", config.get("alpha_pattern")),
            ("fan_in_fan_out", config.get("fan_in_fan_out")),
        )
        if used
    ]
    if unsupported:
        raise LoraAdapterError(f"adapter {directory} uses {', '.join(unsupported)}, which is not served")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise LoraAdapterError(f"{CONFIG_FILE} in {directory} needs an integer r >= 1 and a lora_alpha")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):  # PEFT also stores a regular expression, or "all-linear"
        raise LoraAdapterError(f"target_modules {targets!r} as one string is not served; list the modules")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling), frozenset(str(t) for t in targets)


def load_lora_adapter(
    name: str,
    path: str,
    config: ModelConfig,
    max_rank: int | None = None,
    allowed_modules: frozenset[str] | None = None,
) -> LoraAdapter:
    """Reads and checks the adapter at path against the base model's config, the pool's largest
    rank and the modules the pool holds slots for."""
    directory = Path(path)
    if not directory.is_dir():
        raise LoraAdapterError(f"LoRA adapter {name!r}: {path} is not a directory")
    rank, scaling, targets = read_adapter_config(directory)
    if max_rank is not None and rank > max_rank:
        raise LoraAdapterError(f"LoRA adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}")
    shapes = module_shapes(config)
    unknown = sorted(targets - set(shapes))
    if unknown:
        raise LoraAdapterError(
            f"LoRA adapter {name!r} targets {unknown}, which this model has no LoRA slots for"
        )
    if allowed_modules is not None and not targets <= allowed_modules:
        outside = sorted(targets - allowed_modules)
        raise LoraAdapterError(f"LoRA adapter {name!r} targets {outside}, outside --lora-target-modules")
    weights_file = directory / WEIGHTS_FILE
    if not weights_file.is_file():
        pickled = " (adapter_model.bin is never unpickled: convert it to safetensors)"
        raise LoraAdapterError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {path}" + (
            pickled if (directory / "adapter_model.bin").exists() else ""
        ))  # fmt: skip
    raw = weights_file.read_bytes()
    from safetensors.torch import load as load_safetensors

    try:
        tensors = load_safetensors(raw)
    except Exception as exc:  # safetensors raises its own error types for a corrupt file
        raise LoraAdapterError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} cannot be read: {exc}") from exc
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoraAdapterError(
                f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight this model serves"
            )
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        if layer >= config.num_hidden_layers:
            raise LoraAdapterError(f"LoRA adapter {name!r}: {key} is for layer {layer}; the model has fewer")
        halves.setdefault((layer, module), {})[half] = tensor
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoraAdapterError(f"LoRA adapter {name!r}: layer {layer} {module} lacks lora_A or lora_B")
        fan_in, fan_out = shapes[module]
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoraAdapterError(
                f"LoRA adapter {name!r} does not fit this base model: layer {layer} {module} has A "
                f"{tuple(a.shape)} and B {tuple(b.shape)}, expected {(rank, fan_in)} and {(fan_out, rank)}"
            )
        weights[(layer, module)] = (a, b)
    if not weights:
        raise LoraAdapterError(f"LoRA adapter {name!r} holds no LoRA weights")
    modules = frozenset(module for _, module in weights)
    fingerprint = hashlib.sha256(raw).hexdigest()
    return LoraAdapter(name, str(directory), rank, scaling, modules, weights, fingerprint)
