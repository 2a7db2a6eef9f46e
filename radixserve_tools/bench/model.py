"""The benchmark model: random weights in SmolLM2-135M's exact shape, built locally.

Random weights keep the benchmark offline and licence-free while costing exactly what the real
model costs per token; prompts are token ids, so the tokenizer only has to exist and be valid.
"""

from __future__ import annotations

import json
import shutil
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Mirrors HuggingFaceTB/SmolLM2-135M's config.json (and the peers' make_model.py).
SMOLLM2_135M_CONFIG: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "initializer_range": 0.041666666666666664,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": None,
}

# Llama-3.2-1B's layers with SmolLM2's vocabulary (the local tokenizer's ids and the benches'
# random prompt ids fit it); for GPU runs, where SmolLM2-135M is too small to load the device.
LLAMA_1B_CONFIG: dict[str, Any] = {
    **SMOLLM2_135M_CONFIG,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rope_theta": 500000.0,
    "initializer_range": 0.02,
}

# Qwen3-30B-A3B's layer shape (128 experts of which 8 per token, 768 wide; 32 query heads of 128 over
# 4 KV heads), with 4 of its 48 layers so that it fits the benchmark machines' memory, and
# SmolLM2's vocabulary.
QWEN3_MOE_CONFIG: dict[str, Any] = {
    **SMOLLM2_135M_CONFIG,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "rope_theta": 1000000.0,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
}

MODEL_DIR_NAMES: dict[str, str] = {
    "float32": "smollm2-135m-random",
    "bfloat16": "smollm2-135m-random-bf16",
}

_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TOKENIZER_VOCAB = 1000
_CORPUS_BYTES = 200_000
# Written last, so a directory without it is an interrupted build and gets redone.
_DONE_MARKER = "radixserve-bench-model.json"


def _stdlib_corpus(corpus_bytes: int) -> Iterator[str]:
    """Python stdlib sources in sorted file order, so training is reproducible."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        # Line-sized chunks keep the BPE trainer's word counting cheap.
        yield from text.splitlines(keepends=True)
        total += len(text)
        if total >= corpus_bytes:
            return


def train_tokenizer(
    vocab_size: int = _TOKENIZER_VOCAB, corpus_bytes: int = _CORPUS_BYTES, chat_template: str | None = None
) -> Any:
    """A locally trained byte-level BPE tokenizer with ChatML specials and `<|endoftext|>` as
    id 0 = bos = eos = pad. Used by the benchmark model and by the test fixtures."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_stdlib_corpus(corpus_bytes), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=_SPECIAL_TOKENS[1:],
        chat_template=chat_template,
    )


def model_dirs(out_dir: Path) -> dict[str, Path]:
    """Where each dtype variant lives under `out_dir`."""
    return {dtype: out_dir / name for dtype, name in MODEL_DIR_NAMES.items()}


def _is_complete(path: Path) -> bool:
    return (path / _DONE_MARKER).is_file()


def ensure_random_smollm2(out_dir: Path, dtype: str = "bfloat16") -> Path:
    """Return the `dtype` variant's HF directory under `out_dir`, writing both variants first if
    either is missing. Weights come from `torch.manual_seed(0)`, so rebuilds are identical."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    dirs = model_dirs(out_dir)
    if dtype not in dirs:
        raise ValueError(f"dtype must be one of {', '.join(dirs)}, got {dtype!r}")
    if all(_is_complete(p) for p in dirs.values()):
        return dirs[dtype]

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == 0
    config = LlamaConfig(**SMOLLM2_135M_CONFIG)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # fp32 first: the bf16 variant is a cast of the very same weights.
    for variant in ("float32", "bfloat16"):
        _save_model(model.to(getattr(torch, variant)), tokenizer, dirs[variant], "HuggingFaceTB/SmolLM2-135M")
    return dirs[dtype]


def ensure_random_llama_1b(out_dir: Path, build_device: str = "cpu") -> Path:
    """bf16 random weights in Llama-3.2-1B's shape (its vocabulary aside): a model large enough
    that a GPU's forwards are bound by FLOPs and bytes rather than by kernel launches. Built on
    `build_device` (a GPU initializes 1.2B parameters in a moment)."""
    from transformers import LlamaConfig

    config = LlamaConfig(**LLAMA_1B_CONFIG)
    shape_of = "meta-llama/Llama-3.2-1B (vocabulary: SmolLM2's)"
    return _ensure_random(out_dir / "llama-1b-shape-random-bf16", config, shape_of, build_device)


def ensure_random_qwen3_moe(out_dir: Path) -> Path:
    """bf16 random weights in Qwen3-30B-A3B's layer shape, 4 layers (QWEN3_MOE_CONFIG): an MoE
    whose step reads 8 of each layer's 128 experts, for llama.cpp's tools to convert and quantize."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(**QWEN3_MOE_CONFIG)
    shape_of = "Qwen/Qwen3-30B-A3B, 4 of 48 layers (vocabulary: SmolLM2's)"
    return _ensure_random(out_dir / "qwen3-moe-a3b-shape-4l-random-bf16", config, shape_of, "cpu")


def _ensure_random(final: Path, config: Any, shape_of: str, build_device: str) -> Path:
    """bf16 random weights (seed 0) of `config` with the local tokenizer at `final`, unless a
    complete build is already there."""
    import torch
    from transformers import AutoModelForCausalLM

    if _is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    torch.manual_seed(0)
    with torch.device(build_device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    _save_model(model.eval(), tokenizer, final, shape_of)
    return final


def _save_model(model: Any, tokenizer: Any, final: Path, shape_of: str) -> None:
    """Writes the model and tokenizer beside a marker, renamed into place only when complete."""
    model.generation_config.bos_token_id = 0
    model.generation_config.eos_token_id = 0
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    info = {
        "dtype": str(model.dtype).removeprefix("torch."),
        "params": sum(p.numel() for p in model.parameters()),
        "shape_of": shape_of,
        "seed": 0,
    }
    (tmp / _DONE_MARKER).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def ensure_truncated_smollm2(out_dir: Path, layers: int) -> Path:
    """A draft model for STANDALONE speculation: the packaged SmolLM2-135M-Instruct's first
    `layers` decoder layers, with its final norm and (tied) head, as an fp32 HF directory. The only
    smaller model with this tokenizer available offline; untrained as a draft, it shows what an
    early exit of the model itself agrees with."""
    import torch
    from safetensors.torch import save_file

    from radixserve.models.loader import iter_weights
    from radixserve.models.source import default_model_path, load_model_config, resolve_model_source
    from radixserve.models.tokenizer import load_tokenizer

    final = out_dir / f"smollm2-135m-instruct-first{layers}"
    if _is_complete(final):
        return final
    source = resolve_model_source(default_model_path())
    config = load_model_config(source)
    if not 1 <= layers <= config.num_hidden_layers:
        raise ValueError(f"layers must be in 1..{config.num_hidden_layers}, got {layers}")
    kept: dict[str, torch.Tensor] = {}
    for name, tensor in iter_weights(source, config):
        parts = name.split(".")
        if len(parts) > 2 and parts[1] == "layers" and int(parts[2]) >= layers:
            continue
        kept[name] = tensor.to(torch.float32).contiguous()
    hf_config = {
        **SMOLLM2_135M_CONFIG,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": layers,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "torch_dtype": "float32",
        "bos_token_id": config.eos_token_ids[0] if config.eos_token_ids else 0,
        "eos_token_id": list(config.eos_token_ids),
    }
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(kept, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
    load_tokenizer(source).save_pretrained(tmp)
    info = {"draft_of": str(source.path), "layers": layers}
    (tmp / _DONE_MARKER).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final
