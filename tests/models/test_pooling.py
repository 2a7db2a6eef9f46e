"""Pooling: reading sentence-transformers configs, and pooling segments of a flattened batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from radixserve.forward.batch import ExtendSegment
from radixserve.models.config import ModelConfig, UnsupportedModelError
from radixserve.models.pooling import PoolingConfig, finish_embeddings, pool_segments, read_pooling_config

ENCODER = ModelConfig.from_hf_dict(
    {
        "architectures": ["BertModel"],
        "hidden_size": 8,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "intermediate_size": 16,
        "vocab_size": 10,
    }
)
DECODER = ModelConfig.from_hf_dict(
    {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 8,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "intermediate_size": 16,
        "vocab_size": 10,
    }
)


def write_st_config(folder: Path, pooling: dict[str, bool] | None, normalize: bool) -> Path:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        modules.append(
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
        )
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
        )
    (folder / "modules.json").write_text(json.dumps(modules))
    return folder


def test_defaults_without_sentence_transformers_files(tmp_path: Path) -> None:
    assert read_pooling_config(tmp_path, ENCODER) == PoolingConfig("cls", normalize=True)
    assert read_pooling_config(None, DECODER) == PoolingConfig("last", normalize=True)


@pytest.mark.parametrize(
    ("key", "mode"),
    [
        ("pooling_mode_mean_tokens", "mean"),
        ("pooling_mode_cls_token", "cls"),
        ("pooling_mode_lasttoken", "last"),
    ],
)
@pytest.mark.parametrize("normalize", [True, False])
def test_reads_the_pooling_module(tmp_path: Path, key: str, mode: str, normalize: bool) -> None:
    folder = write_st_config(tmp_path, {key: True, "pooling_mode_max_tokens": False}, normalize)
    assert read_pooling_config(folder, ENCODER) == PoolingConfig(mode, normalize)  # type: ignore[arg-type]


def test_refuses_pooling_it_cannot_do(tmp_path: Path) -> None:
    (tmp_path / "max").mkdir()
    max_pooling = write_st_config(tmp_path / "max", {"pooling_mode_max_tokens": True}, True)
    with pytest.raises(UnsupportedModelError, match="pooling_mode_max_tokens"):
        read_pooling_config(max_pooling, ENCODER)
    (tmp_path / "mean").mkdir()
    mean = write_st_config(tmp_path / "mean", {"pooling_mode_mean_tokens": True}, True)
    with pytest.raises(UnsupportedModelError, match="only last-token"):
        read_pooling_config(mean, DECODER)


def test_pool_segments_matches_a_per_text_loop() -> None:
    torch.manual_seed(0)
    lengths = [3, 1, 5]
    hidden = torch.randn(sum(lengths), 4)
    segments, start = [], 0
    for n in lengths:
        segments.append(ExtendSegment(q_start=start, q_len=n, prefix_len=0, prefix_slots=torch.empty(0)))
        start += n
    texts = hidden.split(lengths)
    torch.testing.assert_close(
        pool_segments(hidden, segments, "mean"), torch.stack([t.mean(0) for t in texts])
    )
    torch.testing.assert_close(pool_segments(hidden, segments, "cls"), torch.stack([t[0] for t in texts]))
    torch.testing.assert_close(pool_segments(hidden, segments, "last"), torch.stack([t[-1] for t in texts]))
    normed = finish_embeddings(hidden[:2], PoolingConfig("mean", normalize=True))
    torch.testing.assert_close(normed.norm(dim=-1), torch.ones(2))
