"""Built-in model shapes for `simulate --model-config NAME`: the fields of published HF
`config.json` files that the cost model and the scheduler read, so that a common model can be
simulated without its config at hand. Any other model: its own config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from radixserve.config.server_args import InvalidArgumentError
from radixserve.models.config import ModelConfig

_LLAMA3_VOCAB = 128256

BUILTIN_MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": _LLAMA3_VOCAB,
        "max_position_embeddings": 131072,
    },
    "llama-3.1-70b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": _LLAMA3_VOCAB,
        "max_position_embeddings": 131072,
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": _LLAMA3_VOCAB,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
    },
    "smollm2-135m": {  # radixserve's default model
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
}


def load_config(spec: str) -> ModelConfig:
    """A built-in shape by name (BUILTIN_MODEL_CONFIGS), an HF config.json, or a folder holding one."""
    if spec.lower() in BUILTIN_MODEL_CONFIGS:
        return ModelConfig.from_hf_dict(BUILTIN_MODEL_CONFIGS[spec.lower()])
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        names = ", ".join(BUILTIN_MODEL_CONFIGS)
        message = f"model config {spec!r} is neither a built-in shape ({names}) nor a config.json"
        raise InvalidArgumentError(message)
    data: dict[str, Any] = json.loads(path.read_text())
    return ModelConfig.from_hf_dict(data)
