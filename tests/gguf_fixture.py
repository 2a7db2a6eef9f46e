"""A tiny HF checkpoint written as llama.cpp's converter would write it: one GGUF file with the
architecture's metadata keys, llama.cpp's tensor names (q/k rows interleaved for arch "llama",
each layer's experts stacked into one 3-D tensor per projection) and the tokenizer as
`tokenizer.ggml.*` metadata. Every tensor is F32 unless `formats` names another format for its
stem: the part of a layer's tensor name between `blk.N.` and `.weight` ("attn_qkv",
"ffn_up_exps", ...; every layer's alike), or a global tensor's name without it ("token_embd").

`dequantized_dir` writes the checkpoint those quantized tensors stand for (each rounded through
its format and back), for transformers to serve as the oracle of the quantized file.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

# HF model_type -> the architecture name llama.cpp gives the file. Mistral and Mixtral are "llama".
_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "olmoe": "olmoe",
}
# Formats a tensor may be written in (gguf's own quantizer rounds them, as llama.cpp's does).
FORMATS = ("F32", "Q8_0", "Q4_0")
_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
# An expert's projection as the stacked tensor's stem names it.
_EXPERT_STEM = {
    "gate_proj": "ffn_gate_exps",
    "w1": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "w3": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
    "w2": "ffn_down_exps",
}
_BLOCK_STEM = re.compile(r"^blk\.\d+\.([a-z_]+)\.(?:weight|bias)$")


def _stem(gguf_name: str) -> str:
    match = _BLOCK_STEM.match(gguf_name)
    return match.group(1) if match else gguf_name.removesuffix(".weight").removesuffix(".bias")


def _quant_type(fmt: str) -> Any:
    from gguf import GGMLQuantizationType

    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: the writer offers {FORMATS}")
    return GGMLQuantizationType[fmt]


def _interleave_rotary_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's half-split rotary rows of each head as llama.cpp's arch "llama" stores them: the two
    halves' rows alternating (row i of the first half, then row i of the second)."""
    half = w.shape[0] // heads // 2
    return np.ascontiguousarray(w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _hparams(model_dir: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    config["_rope"] = rope
    config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    return config


def _write_tokenizer(writer: Any, model_dir: Path) -> None:
    """The vocabulary in id order with each token's type, the merges, the special ids and the chat
    template: what llama.cpp's converter writes for a byte-level BPE tokenizer."""
    from gguf import SpecialVocab, TokenType
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(len(by_id)):
        tokens.append(by_id[index])
        if index in added:
            types.append(TokenType.CONTROL if added[index].special else TokenType.USER_DEFINED)
        else:
            types.append(TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    SpecialVocab(model_dir, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer)


def _write_hparams(writer: Any, arch: str, hp: dict[str, Any]) -> None:
    """The architecture's metadata keys, as the converter writes them for these models."""
    hidden, heads = int(hp["hidden_size"]), int(hp["num_attention_heads"])
    head_dim = int(hp.get("head_dim") or hidden // heads)
    rope = hp["_rope"]
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    writer.add_context_length(int(hp["max_position_embeddings"]))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(int(hp["intermediate_size"]))
    writer.add_block_count(int(hp["num_hidden_layers"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(hp.get("num_key_value_heads") or heads))
    writer.add_rope_freq_base(float(hp["rope_theta"]))
    # The converter writes OLMoE's epsilon, 1e-5, whatever the config says, and no clip_qkv.
    if arch == "olmoe" and (hp.get("clip_qkv") or float(hp["rms_norm_eps"]) != 1e-5):
        raise ValueError("llama.cpp's olmoe file holds no clip_qkv and an epsilon of 1e-5")
    writer.add_layer_norm_rms_eps(float(hp["rms_norm_eps"]))
    if arch == "phi3":
        # Phi-3's converter states the rotary width in dimensions (of hidden / heads, not head_dim),
        # the original context always, and a window of 0 for none.
        partial = float(hp.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
        writer.add_rope_dimension_count(int(partial * hidden) // heads)
        original = int(
            hp.get("original_max_position_embeddings")
            or rope.get("original_max_position_embeddings")
            or hp["max_position_embeddings"]
        )
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_sliding_window(int(hp.get("sliding_window") or 0))
        if rope_type == "longrope":
            factor = int(hp["max_position_embeddings"]) / original
            attn = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
            writer.add_rope_scaling_attn_factors(attn)
        elif rope_type != "default":
            raise ValueError(f"this test writer writes no phi3 rope {rope_type!r}")
    else:
        if rope_type != "default":
            raise ValueError(f"this test writer writes no {rope_type!r} rope for {arch}")
        if arch == "llama":
            writer.add_rope_dimension_count(head_dim)
        if hp.get("head_dim"):
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
        sliding = hp.get("use_sliding_window", True) and hp.get("sliding_window")
        if sliding and hp["model_type"] != "llama":  # Llama ignores the key
            raise ValueError("this test writer writes no sliding window but Phi-3's")
    experts = hp.get("num_local_experts") or hp.get("num_experts")
    if experts:
        writer.add_expert_count(int(experts))
        writer.add_expert_used_count(int(hp["num_experts_per_tok"]))
        if hp.get("moe_intermediate_size"):
            writer.add_expert_feed_forward_length(int(hp["moe_intermediate_size"]))
        if hp.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(int(hp["shared_expert_intermediate_size"]))


class _Names:
    """HF tensor names as llama.cpp's converter names them in one architecture's file."""

    def __init__(self, arch: str, layers: int):
        import gguf

        arch_enum = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
        self.names = gguf.get_tensor_name_map(arch_enum, layers)
        # A dense layer in a MoE file (Qwen3-MoE's mlp_only_layers): its MLP under the plain ffn_*
        # names, which llama.cpp's own qwen3moe has no place for.
        self.fallback = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)

    def of(self, hf_name: str) -> tuple[str, int | None]:
        """(the file's tensor name, the expert's index where the tensor is one slice of a stack)."""
        expert = _EXPERT.match(hf_name)
        if expert is not None:
            stem = _EXPERT_STEM[expert.group(3)]
            return f"blk.{expert.group(1)}.{stem}.weight", int(expert.group(2))
        module, _, suffix = hf_name.rpartition(".")
        mapped = self.names.get_name(module) or self.fallback.get_name(module)
        if mapped is None:
            raise ValueError(f"no llama.cpp name for {hf_name}")
        return f"{mapped}.{suffix}", None


def _gguf_tensors(arch: str, hp: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """llama.cpp's name -> fp32 array (numpy row-major: the reverse of the file's dims)."""
    names = _Names(arch, int(hp["num_hidden_layers"]))
    heads = int(hp["num_attention_heads"])
    kv_heads = int(hp.get("num_key_value_heads") or heads)
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, tensor in tensors.items():
        values = tensor.float().numpy()
        name, expert = names.of(hf_name)
        if expert is not None:
            stacks.setdefault(name, {})[expert] = values
            continue
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            values = _interleave_rotary_rows(values, heads if ".q_proj." in hf_name else kv_heads)
        if _stem(name) == "ffn_gate_inp_shexp":
            values = values.reshape(-1)  # one row: the file keeps it as a vector
        out[name] = values
    for name, by_index in stacks.items():
        out[name] = np.stack([by_index[i] for i in range(len(by_index))])
    rope = hp["_rope"]
    if rope.get("rope_type") == "longrope":
        out["rope_factors_long.weight"] = np.asarray(rope["long_factor"], dtype=np.float32)
        out["rope_factors_short.weight"] = np.asarray(rope["short_factor"], dtype=np.float32)
    return out


def write_gguf(model_dir: Path, out: Path, formats: Mapping[str, str] | None = None) -> Path:
    """model_dir (an HF checkpoint with one model.safetensors and a tokenizer.json) as the GGUF
    `out`. formats: tensor stem -> "Q8_0" / "Q4_0" (F32 where not named)."""
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
    from gguf.quants import quantize

    formats = dict(formats or {})
    hp = _hparams(model_dir)
    arch = _ARCH[str(hp["model_type"])]
    tensors = load_file(model_dir / "model.safetensors")
    arrays = _gguf_tensors(arch, hp, tensors)
    unknown = set(formats) - {_stem(name) for name in arrays}
    if unknown:
        raise ValueError(f"formats name tensors the file does not have: {sorted(unknown)}")

    out.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(out), arch)
    writer.add_name(model_dir.name)
    used = {formats[s] for s in formats} - {"F32"}
    file_type = LlamaFileType.ALL_F32
    if used:
        file_type = LlamaFileType.MOSTLY_Q8_0 if "Q8_0" in used else LlamaFileType.MOSTLY_Q4_0
    writer.add_file_type(file_type)
    _write_hparams(writer, arch, hp)
    _write_tokenizer(writer, model_dir)
    for name, values in arrays.items():
        kind = _quant_type(formats.get(_stem(name), "F32"))
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
        else:
            writer.add_tensor(name, quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def dequantized_dir(model_dir: Path, out: Path, formats: Mapping[str, str]) -> Path:
    """A copy of model_dir whose tensors are the values write_gguf(model_dir, ..., formats) stores:
    those it quantizes rounded through their format and back (blocks run along each row, so the
    file's row order and stacking do not change them)."""
    from gguf.quants import dequantize, quantize

    hp = _hparams(model_dir)
    arch = _ARCH[str(hp["model_type"])]
    tensors = load_file(model_dir / "model.safetensors")
    out.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if item.name != "model.safetensors" and item.is_file():
            shutil.copyfile(item, out / item.name)
    names = _Names(arch, int(hp["num_hidden_layers"]))
    for name, tensor in tensors.items():
        fmt = formats.get(_stem(names.of(name)[0]), "F32")
        if fmt != "F32":
            kind = _quant_type(fmt)
            values = dequantize(quantize(tensor.float().numpy(), kind), kind)
            tensors[name] = torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(tensor.shape))
    save_file(tensors, out / "model.safetensors")
    return out
