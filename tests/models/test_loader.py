"""Streaming a checkpoint's weights (models/loader.py): safetensors and GGUF, against
transformers' own loading of the same files."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from radixserve.layers.quantized import QuantizedTensor
from radixserve.models import loader, source
from radixserve.models.config import ModelLoadError, UnsupportedModelError
from radixserve.models.loader import expected_weight_names, iter_weights
from radixserve.models.source import ModelSource, load_model_config
from tests.models.test_source import ARCH_NAMES


def _hf_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """transformers' parameters by name; a fused qkv_proj / gate_up_proj (Phi-3) as the per-
    projection tensors the loader yields, cut by the config's sizes."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sd = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    c = model.config
    q, kv, ff = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
    fused = {
        "qkv_proj": {"q_proj": q, "k_proj": kv, "v_proj": kv},
        "gate_up_proj": {"gate_proj": ff, "up_proj": ff},
    }
    for name in list(sd):
        key = next((key for key in fused if f".{key}." in name), None)
        if key is not None:
            pieces = sd.pop(name).split(list(fused[key].values()))
            sd.update(
                {name.replace(key, part): piece for part, piece in zip(fused[key], pieces, strict=True)}
            )
    return sd


# --------------------------------------------------------------------------------------
# safetensors weights
# --------------------------------------------------------------------------------------


def _checkpoint_names(model_dir: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            names |= set(f.keys())
    return names


def _assert_matches_hf(model_dir: Path) -> None:
    src = ModelSource("hf_dir", model_dir)
    cfg = load_model_config(src)
    ours = list(iter_weights(src, cfg))
    names = [name for name, _ in ours]
    assert len(names) == len(set(names))
    ref = _hf_state_dict(model_dir)
    assert set(names) == set(ref)
    assert set(expected_weight_names(cfg)) == set(_checkpoint_names(model_dir))
    for name, tensor in ours:
        assert tensor.device.type == "cpu"
        assert tensor.dtype == torch.float32
        assert tensor.shape == ref[name].shape, name
        assert torch.equal(tensor, ref[name]), name


@pytest.mark.parametrize("arch", list(ARCH_NAMES))
def test_hf_weights_match_transformers(arch: str, tiny_model_dir: Callable[[str], Path]) -> None:
    _assert_matches_hf(tiny_model_dir(arch))


def test_sharded_weights_match_transformers(tiny_model_sharded_dir: Path) -> None:
    _assert_matches_hf(tiny_model_sharded_dir)


def test_missing_safetensors_rejects_pickle(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    shutil.copy(tiny_model_dir("qwen2") / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    src = ModelSource("hf_dir", tmp_path)
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin.*not supported"):
        list(iter_weights(src, load_model_config(src)))


def test_unexpected_tensor_is_rejected(tiny_model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    for f in tiny_model_dir("mistral").iterdir():
        shutil.copy(f, tmp_path / f.name)
    save_file({"model.layers.0.mlp.gate_proj.bias": torch.zeros(128)}, str(tmp_path / "extra.safetensors"))
    (tmp_path / "model.safetensors").rename(tmp_path / "base.safetensors")
    src = ModelSource("hf_dir", tmp_path)
    with pytest.raises(UnsupportedModelError, match=r"gate_proj\.bias"):
        list(iter_weights(src, load_model_config(src)))


@pytest.fixture(scope="module")
def gguf_src(smollm2_gguf_path: Path) -> ModelSource:
    return ModelSource("gguf", smollm2_gguf_path)


@pytest.fixture(scope="module")
def gguf_weights(gguf_src: ModelSource) -> dict[str, torch.Tensor]:
    return dict(iter_weights(gguf_src, load_model_config(gguf_src)))


def test_gguf_weights_match_transformers(
    gguf_src: ModelSource, gguf_weights: dict[str, torch.Tensor]
) -> None:
    """Compare against transformers' own GGUF import pipeline.

    ``AutoModelForCausalLM.from_pretrained(gguf_file=...)`` needs `accelerate` (not a
    dependency) and spends ~15 s rebuilding name maps, so drive the same pieces directly:
    transformers' GGUF config parser and its llama tensor processor (which un-permutes q/k),
    with gguf-py's canonical HF->GGUF name map.
    """
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    hf_config = AutoConfig.from_pretrained(gguf_src.path.parent, gguf_file=gguf_src.path.name)
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(hf_config)
    expected = {k: v.shape for k, v in meta_model.state_dict().items() if k != "lm_head.weight"}
    assert {k: v.shape for k, v in gguf_weights.items()} == expected

    reader = source.gguf_reader(gguf_src.path)
    tensors = {t.name: t for t in reader.tensors}
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, hf_config.num_hidden_layers)
    processor = TENSOR_PROCESSORS["llama"](config=hf_config.to_dict())
    checked = [
        "model.embed_tokens.weight",
        "model.norm.weight",
        *(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.29.self_attn.q_proj.weight",
        "model.layers.29.self_attn.k_proj.weight",
        "model.layers.17.post_attention_layernorm.weight",
    ]
    for hf_name in checked:
        module, suffix = hf_name.rsplit(".", 1)
        gguf_name = f"{name_map.get_name(module)}.{suffix}"
        t = tensors[gguf_name]
        raw = gguf.quants.dequantize(t.data, t.tensor_type)
        ref = processor.process(weights=raw, name=gguf_name).weights
        ours = gguf_weights[hf_name]
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, torch.from_numpy(np.array(ref)), atol=1e-5, rtol=0, msg=hf_name)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    rng = np.random.default_rng(0)
    for shape, heads in (((3 * 8, 5), 3), ((2 * 16,), 2)):
        w = rng.standard_normal(shape).astype(np.float32)
        np.testing.assert_array_equal(loader._unpermute_qk(llama_cpp_permute(w, heads), heads), w)


def test_gguf_blocks_kept_quantized_are_views_of_the_file(
    gguf_src: ModelSource, gguf_weights: dict[str, torch.Tensor]
) -> None:
    """Every matrix kept in its blocks is a view of the mapped file, q/k included (their rows
    reordered by row_order, not copied), and reads back as the dequantizing loader's tensor."""
    kept = dict(iter_weights(gguf_src, load_model_config(gguf_src), keep_quantized=True))
    quantized = {name: t for name, t in kept.items() if isinstance(t, QuantizedTensor)}
    assert quantized and all(t.mapped for t in quantized.values())
    reordered = {name for name, t in quantized.items() if t.row_order is not None}
    assert reordered == {n for n in quantized if ".q_proj." in n or ".k_proj." in n}
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        assert torch.equal(quantized[name].dequantize(), gguf_weights[name])
