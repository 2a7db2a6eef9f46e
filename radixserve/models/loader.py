"""Stream a checkpoint's weights (its location and config: models/source.py; its tokenizer:
models/tokenizer.py).

Two on-disk formats are supported: HF directories (safetensors) and single-file GGUF. Either way,
weights come out under HF Llama/Qwen parameter names so the model code has a single naming scheme
to deal with: a GGUF's stacked experts (one 3-D tensor per projection and layer) as one tensor per
expert, Phi-3's fused projections split as a safetensors' are.
"""

from __future__ import annotations

import logging
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
import torch
from tqdm import tqdm

from radixserve.layers.quantized import KEPT_FORMATS, QuantFormat, QuantizedTensor, WeightTensor
from radixserve.models.config import (
    FUSED_PROJECTION_ARCHITECTURES,
    SANDWICH_NORM_ARCHITECTURES,
    ModelConfig,
    ModelLoadError,
    UnsupportedModelError,
)
from radixserve.models.moe import SparseMoE
from radixserve.models.source import ModelSource, gguf_architecture, gguf_reader, read_json

__all__ = ["expected_weight_names", "iter_weights", "quantize_linears"]

logger = logging.getLogger(__name__)

# Plain GGUF tensor types: loaded as they are (to fp32), never "kept quantized".
_GGUF_PLAIN_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
# The linear layers' weights, which --quantization quantizes in a safetensors checkpoint.
_LINEAR_WEIGHT = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")

# GGUF per-block tensor stem -> HF module path under model.layers.{i}.
_GGUF_BLOCK_TO_HF: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Qwen2-MoE's shared expert and its gate (a sparse layer's router: _gguf_targets).
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Per architecture, where llama.cpp's names mean something else: Gemma 3's four norms per layer
# (its ffn_norm is the one before the MLP), and Phi-3's ffn_up, which holds gate's rows then up's.
_GGUF_ARCH_BLOCK_TO_HF: dict[str, dict[str, str]] = {
    "gemma3": {
        **_GGUF_BLOCK_TO_HF,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "phi3": {**_GGUF_BLOCK_TO_HF, "ffn_up": "mlp.gate_up_proj"},
}
# A sparse layer's experts, each projection stacked into one 3-D tensor [expert, rows, cols]
# (numpy's order): yielded as one 2-D tensor per expert.
_GGUF_EXPERTS: dict[str, str] = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
# The routers stay dense whatever the file's type: a few rows each, which llama.cpp's quantizer
# leaves unquantized too.
_GGUF_ALWAYS_DENSE = frozenset({"ffn_gate_inp", "ffn_gate_inp_shexp"})
_GGUF_GLOBAL_TO_HF: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Consumed into ModelConfig.rope_scaling (llama3's and Phi-3's LongRoPE factors) rather than
# yielded as parameters.
_GGUF_CONFIG_TENSORS = frozenset(
    {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
)

# Non-parameter buffers that some older HF checkpoints persisted.
_HF_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# LLaVA checkpoint prefix -> the name prefix we yield (first match wins, so longer prefixes come
# first). Text tensors take the plain text-model names; the image encoder goes under "vision.".
# transformers 5 save_pretrained writes language_model.model.* / language_model.lm_head /
# vision_tower.* / multi_modal_projector.*; other writers use the in-memory layout (model.*
# prefixed, lm_head at the top), and older ones keep CLIPVisionModel's "vision_model." level.
_LLAVA_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "vision.tower."),
    ("model.vision_tower.", "vision.tower."),
    ("vision_tower.vision_model.", "vision.tower."),
    ("vision_tower.", "vision.tower."),
    ("model.multi_modal_projector.", "vision.projector."),
    ("multi_modal_projector.", "vision.projector."),
)
# A non-parameter buffer that checkpoints from before transformers 4.31 persisted.
_LLAVA_IGNORED_NAMES = frozenset({"vision.tower.embeddings.position_ids"})


def _encoder_weight_names(config: ModelConfig) -> list[str]:
    names = [f"embeddings.{e}_embeddings.weight" for e in ("word", "position", "token_type")]
    names += ["embeddings.LayerNorm.weight", "embeddings.LayerNorm.bias"]
    for i in range(config.num_hidden_layers):
        p = f"encoder.layer.{i}"
        for module in ("attention.self.query", "attention.self.key", "attention.self.value",
                       "attention.output.dense", "attention.output.LayerNorm",
                       "intermediate.dense", "output.dense", "output.LayerNorm"):  # fmt: skip
            names += [f"{p}.{module}.weight", f"{p}.{module}.bias"]
    return names


def expected_weight_names(config: ModelConfig) -> list[str]:
    """Every HF parameter name a checkpoint for ``config`` must provide, in model order."""
    if config.is_encoder:
        return _encoder_weight_names(config)
    fused = config.architecture in FUSED_PROJECTION_ARCHITECTURES
    names = ["model.embed_tokens.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        for proj in ("qkv",) if fused else ("q", "k", "v"):
            names.append(f"{p}.self_attn.{proj}_proj.weight")
            if config.attention_bias:
                names.append(f"{p}.self_attn.{proj}_proj.bias")
        names.append(f"{p}.self_attn.o_proj.weight")
        if config.qk_norm:
            names += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
        mlp = ("gate_up", "down") if fused else ("gate", "up", "down")
        if i in config.sparse_layers and config.architecture == "MixtralForCausalLM":
            names += [f"{p}.{_mixtral_name(name)}" for name in SparseMoE.checkpoint_names(config)]
        elif i in config.sparse_layers:
            names += [f"{p}.mlp.{name}" for name in SparseMoE.checkpoint_names(config)]
        else:
            names += [f"{p}.mlp.{proj}_proj.weight" for proj in mlp]
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        if config.architecture in SANDWICH_NORM_ARCHITECTURES:
            names += [f"{p}.pre_feedforward_layernorm.weight", f"{p}.post_feedforward_layernorm.weight"]
    names.append("model.norm.weight")
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def _check_names(present: set[str], config: ModelConfig, where: Path) -> None:
    expected = set(expected_weight_names(config))
    missing = sorted(expected - present)
    extra = sorted(present - expected)
    if extra:
        raise UnsupportedModelError(
            f"{where} has tensors radixserve's {config.architecture} does not use "
            f"(unsupported variant?): {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}"
        )
    if missing:
        raise ModelLoadError(f"{where} is missing {len(missing)} tensors, e.g. {', '.join(missing[:5])}")


def _llava_name(key: str) -> str | None:
    for prefix, ours in _LLAVA_PREFIXES:
        if key.startswith(prefix):
            return ours + key[len(prefix) :]
    return None


def _rename_llava(keys: list[str], where: Path) -> list[tuple[str, str]]:
    """(checkpoint key, our name) for a LLaVA shard's keys; unknown keys are an error."""
    out: list[tuple[str, str]] = []
    unknown: list[str] = []
    for key in keys:
        name = _llava_name(key)
        if name is None:
            unknown.append(key)
        elif name not in _LLAVA_IGNORED_NAMES:
            out.append((key, name))
    if unknown:
        raise UnsupportedModelError(
            f"{where} has tensors radixserve's LLaVA loader cannot map: "
            f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}"
        )
    return out


def _progress(total: int, desc: str) -> tqdm:
    # disable=None: draw on an interactive terminal, stay silent in logs and CI.
    return tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, disable=None, leave=False)


@overload
def iter_weights(
    src: ModelSource, config: ModelConfig, keep_quantized: Literal[False] = False
) -> Iterator[tuple[str, torch.Tensor]]: ...
@overload
def iter_weights(
    src: ModelSource, config: ModelConfig, keep_quantized: bool
) -> Iterator[tuple[str, WeightTensor]]: ...
def iter_weights(
    src: ModelSource, config: ModelConfig, keep_quantized: bool = False
) -> Iterator[tuple[str, WeightTensor]]:
    """Yield ``(hf_name, cpu_tensor)`` for every parameter the model needs.

    Safetensors weights keep their stored dtype. GGUF weights are dequantized to float32, except
    with ``keep_quantized`` the matrices in a format with a native kernel (layers/quantized.py),
    which come as QuantizedTensor in the file's own blocks.
    Names are validated up front so a mismatched checkpoint fails before any copying. For a
    vision-language model (``config.vision``), the image encoder's tensors come too, named
    ``vision.tower.<CLIP vision model name>`` and ``vision.projector.<name>``; only the text
    model's names are validated here (VisionTower.load_weights checks the rest).
    """
    if src.kind == "hf_dir":
        weights = _iter_safetensors(src.path, config)
    else:
        weights = _iter_gguf(src.path, config, keep_quantized)
    if config.architecture == "MixtralForCausalLM":
        return ((model_name(config, name), tensor) for name, tensor in weights)
    return _split_fused(weights, config) if config.architecture in FUSED_PROJECTION_ARCHITECTURES else weights


# Mixtral's names for a sparse layer's tensors: block_sparse_moe.{gate, experts.E.w1 (gate),
# w3 (up), w2 (down)}; ours (and Qwen-MoE's): mlp.{gate, experts.E.{gate,up,down}_proj}.
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_FROM_OURS = {ours: theirs for theirs, ours in _MIXTRAL_PROJ.items()}
_MIXTRAL_TO_OURS = re.compile(r"\.block_sparse_moe\.(?:experts\.(\d+)\.(w[123])\.|gate\.)")


def model_name(config: ModelConfig, name: str) -> str:
    """A checkpoint tensor's name as the model resolves it (Mixtral's sparse layers renamed)."""
    if config.architecture == "MixtralForCausalLM":
        return _MIXTRAL_TO_OURS.sub(_ours, name)
    return name


def _ours(match: re.Match[str]) -> str:
    if match.group(1) is None:
        return ".mlp.gate."
    return f".mlp.experts.{match.group(1)}.{_MIXTRAL_PROJ[match.group(2)]}."


def _mixtral_name(ours: str) -> str:
    """A sparse layer's tensor (as SparseMoE.checkpoint_names names it) as Mixtral names it."""
    if ours == "gate.weight":
        return "block_sparse_moe.gate.weight"
    expert, proj, param = ours.removeprefix("experts.").split(".")
    mixtral = _MIXTRAL_FROM_OURS[proj]
    return f"block_sparse_moe.experts.{expert}.{mixtral}.{param}"


def _split_fused(
    weights: Iterator[tuple[str, WeightTensor]], config: ModelConfig
) -> Iterator[tuple[str, WeightTensor]]:
    """A fused qkv_proj as q_proj, k_proj and v_proj, and a fused gate_up_proj as gate_proj and
    up_proj: row ranges of the one tensor (views; a quantized one's rows are whole blocks)."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    ff = config.intermediate_size
    splits = {
        ".self_attn.qkv_proj.": (("self_attn.q_proj", q), ("self_attn.k_proj", kv), ("self_attn.v_proj", kv)),
        ".mlp.gate_up_proj.": (("mlp.gate_proj", ff), ("mlp.up_proj", ff)),
    }
    for name, tensor in weights:
        key = next((key for key in splits if key in name), None)
        if key is None:
            yield name, tensor
            continue
        layer, param = name.split(key)
        parts = splits[key]
        if tensor.shape[0] != sum(size for _, size in parts):
            raise ModelLoadError(f"{name} has {tensor.shape[0]} rows, expected {sum(s for _, s in parts)}")
        start = 0
        for part, size in parts:
            if isinstance(tensor, QuantizedTensor):
                yield f"{layer}.{part}.{param}", tensor.narrow_rows(start, size)
            else:
                yield f"{layer}.{part}.{param}", tensor.narrow(0, start, size)
            start += size


def quantize_linears(
    weights: Iterator[tuple[str, WeightTensor]], format_name: str
) -> Iterator[tuple[str, WeightTensor]]:
    """--quantization: the linear layers' weights quantized into a GGUF format (gguf's own
    quantizer, as llama.cpp's reference rounds); a weight whose inputs do not fill whole blocks
    stays as it is."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    fmt = KEPT_FORMATS[format_name.upper()]
    for name, tensor in weights:
        if (
            isinstance(tensor, torch.Tensor)
            and _LINEAR_WEIGHT.search(name)
            and tensor.dim() == 2
            and tensor.shape[1] % fmt.block == 0
        ):
            blocks = quantize(tensor.float().numpy(), GGMLQuantizationType(fmt.type_id))
            yield name, QuantizedTensor(fmt, torch.from_numpy(blocks), int(tensor.shape[1]))
        else:
            yield name, tensor


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index} has no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"Shards listed in {index.name} are missing: {', '.join(absent)}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    hint = f" Found {', '.join(pickles)}, but" if pickles else ""
    raise ModelLoadError(
        f"No *.safetensors weights in {path}.{hint} pickle-based (.bin/.pt) checkpoints are not "
        "supported because loading them can execute arbitrary code; convert to safetensors first."
    )


def _iter_safetensors(path: Path, config: ModelConfig) -> Iterator[tuple[str, WeightTensor]]:
    from safetensors import safe_open

    files = _safetensors_files(path)
    # Per shard: (key in the file, name we yield it under).
    plan: list[tuple[Path, list[tuple[str, str]]]] = []
    present: set[str] = set()
    vision: set[str] = set()
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            keys = [k for k in f.keys() if not k.endswith(_HF_IGNORED_SUFFIXES)]  # noqa: SIM118
        if config.is_encoder:
            # The pooler head (next-sentence prediction) is unused by sentence embeddings.
            keys = [k for k in keys if not k.startswith("pooler.") and k != "embeddings.position_ids"]
        names = _rename_llava(keys, path) if config.vision is not None else [(k, k) for k in keys]
        if config.tie_word_embeddings:
            # Some tied checkpoints still serialise the shared matrix a second time.
            names = [(k, n) for k, n in names if n != "lm_head.weight"]
        for _, name in names:
            # Two LLaVA layouts mixed in one checkpoint would otherwise load one tensor twice.
            if config.vision is not None and (name in present or name in vision):
                raise ModelLoadError(f"{path} holds two tensors that both map to {name}")
            (vision if config.vision is not None and name.startswith("vision.") else present).add(name)
        plan.append((file, names))
        total += len(names)
    _check_names(present, config, path)

    with _progress(total, "Loading weights") as bar:
        for file, names in plan:
            with safe_open(str(file), framework="pt") as f:
                for key, name in names:
                    yield name, f.get_tensor(key)
                    bar.update(1)


def _gguf_to_hf_name(name: str, arch: str) -> str | None:
    """A GGUF tensor's HF name (None: not one of the plain tensors; experts: _gguf_targets)."""
    if name in _GGUF_GLOBAL_TO_HF:
        return _GGUF_GLOBAL_TO_HF[name]
    blocks = _GGUF_ARCH_BLOCK_TO_HF.get(arch, _GGUF_BLOCK_TO_HF)
    m = _GGUF_BLOCK_RE.match(name)
    if m is None or m.group(2) not in blocks:
        return None
    return f"model.layers.{m.group(1)}.{blocks[m.group(2)]}.{m.group(3)}"


def _gguf_targets(name: str, shape: tuple[int, ...], arch: str, config: ModelConfig) -> list[str] | None:
    """The HF names a GGUF tensor is yielded under: one, or a stacked expert tensor's one per
    expert (in order); None for a tensor with no place. A Mixtral's sparse layers take Mixtral's
    checkpoint names (block_sparse_moe.*), which iter_weights renames as it does a safetensors'."""
    m = _GGUF_BLOCK_RE.match(name)
    if m is not None and m.group(2) in _GGUF_EXPERTS and m.group(3) == "weight":
        if len(shape) != 3:
            raise ModelLoadError(f"{name} has shape {shape}; stacked experts are [expert, rows, cols]")
        sparse = [f"experts.{e}.{_GGUF_EXPERTS[m.group(2)]}.weight" for e in range(shape[0])]
    elif m is not None and m.group(2) == "ffn_gate_inp" and m.group(3) == "weight":
        sparse = ["gate.weight"]
    else:
        hf_name = _gguf_to_hf_name(name, arch)
        return None if hf_name is None else [hf_name]
    layer = f"model.layers.{m.group(1)}"
    if config.architecture == "MixtralForCausalLM":
        return [f"{layer}.{_mixtral_name(n)}" for n in sparse]
    return [f"{layer}.mlp.{n}" for n in sparse]


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's rotary row interleave for q/k projections (weights or biases).

    The converter regroups each head's rows from HF's half-split rotary layout into
    interleaved pairs (reshape(n_head, 2, hd/2, ...).swapaxes(1, 2)); swapping the same two
    axes back from the (n_head, hd/2, 2, ...) view restores HF order.
    """
    rows = w.shape[0]
    if rows % (2 * n_head) != 0:
        raise ModelLoadError(f"q/k projection with {rows} rows does not split into {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _iter_gguf(path: Path, config: ModelConfig, keep_quantized: bool) -> Iterator[tuple[str, WeightTensor]]:
    from gguf.quants import dequantize

    reader = gguf_reader(path)
    arch, _ = gguf_architecture(reader)
    # Per file tensor: its row-major shape (ggml lists dims fastest-first) and the names it yields.
    plan: list[tuple[Any, tuple[int, ...], list[str]]] = []
    unknown: list[str] = []
    for tensor in reader.tensors:
        if tensor.name in _GGUF_CONFIG_TENSORS:
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        names = _gguf_targets(tensor.name, shape, arch, config)
        if names is None:
            unknown.append(tensor.name)
        else:
            plan.append((tensor, shape, names))
    if unknown:
        raise UnsupportedModelError(
            f"{path.name} has GGUF tensors radixserve cannot map: {', '.join(unknown[:5])}"
        )
    _check_names({name for _, _, names in plan for name in names}, config, path)
    if keep_quantized:
        others = sorted({t.tensor_type.name for t, _, _ in plan} - set(KEPT_FORMATS) - _GGUF_PLAIN_TYPES)
        if others:
            logger.info(
                "%s: %s tensors are dequantized at load: radixserve has no kernel for them (it keeps %s)",
                path.name, ", ".join(others), ", ".join(KEPT_FORMATS),
            )  # fmt: skip

    with _progress(sum(len(names) for _, _, names in plan), "Loading GGUF") as bar:
        for tensor, shape, names in plan:
            stem = m.group(2) if (m := _GGUF_BLOCK_RE.match(tensor.name)) else ""
            stacked = stem in _GGUF_EXPERTS
            matrix = len(shape) == (3 if stacked else 2) and stem not in _GGUF_ALWAYS_DENSE
            kept = KEPT_FORMATS.get(tensor.tensor_type.name) if keep_quantized and matrix else None
            if kept is not None:
                # The blocks as stored, [rows, row bytes] (an expert's: a slice of the stack): views
                # of the memory-mapped file, from which the kernel's packed copy is made, and whose
                # pages serve reading the weights back (and embedding lookups).
                blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(*shape[:-1], -1)
                for index, hf_name in enumerate(names):
                    part = blocks[index] if stacked else blocks
                    yield hf_name, _kept_block_view(part, kept, shape[-1], hf_name, arch, config)
                    bar.update(1)
                continue
            values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
            for index, hf_name in enumerate(names):
                yield (
                    hf_name,
                    _dense_weight(values[index] if stacked else values, stem, hf_name, arch, config),
                )
                bar.update(1)


def _is_permuted(hf_name: str, arch: str) -> bool:
    """llama.cpp's arch "llama" stores q/k with each head's rotary halves interleaved."""
    return arch == "llama" and (".self_attn.q_proj." in hf_name or ".self_attn.k_proj." in hf_name)


def _heads(hf_name: str, config: ModelConfig) -> int:
    return config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads


def _kept_block_view(
    blocks: np.ndarray, kept: QuantFormat, cols: int, hf_name: str, arch: str, config: ModelConfig
) -> QuantizedTensor:
    """A matrix in the file's blocks, read in place: rows are independent, so permuted q/k rows
    are read in the HF order (row_order), not copied."""
    order = None
    if _is_permuted(hf_name, arch):
        order = torch.from_numpy(_unpermute_qk(np.arange(blocks.shape[0]), _heads(hf_name, config)))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return QuantizedTensor(kept, torch.from_numpy(blocks), cols, True, order)


def _dense_weight(
    values: np.ndarray, stem: str, hf_name: str, arch: str, config: ModelConfig
) -> torch.Tensor:
    """A tensor as the model takes it, copied: values may be a read-only view of the mapped file."""
    if _is_permuted(hf_name, arch):
        values = _unpermute_qk(values, _heads(hf_name, config))
    weight = torch.from_numpy(np.array(values, copy=True))
    if stem == "ffn_gate_inp_shexp":
        weight = weight.reshape(1, -1)  # one row, which the file keeps as a vector
    if arch == "gemma3" and hf_name.endswith("norm.weight"):
        # llama.cpp stores Gemma's norm weights with the 1 its norm adds folded in (as transformers,
        # which takes it out again on reading the file).
        weight -= 1
    return weight
