"""Turning a text's hidden states into one embedding vector, as sentence-transformers does.

The pooling mode and normalization come from the checkpoint's sentence-transformers files
(modules.json, then the Pooling module's config.json). Without them: CLS for encoders and the
last token for decoders, both L2-normalized (SGLang's behaviour for embedding models).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from radixserve.forward.batch import ExtendSegment
from radixserve.models.config import ModelConfig, UnsupportedModelError

PoolingMode = Literal["mean", "cls", "last"]

_ST_POOLING_KEYS: dict[str, PoolingMode] = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}


@dataclass(frozen=True)
class PoolingConfig:
    mode: PoolingMode
    normalize: bool


def _read(path: Path) -> object:
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise UnsupportedModelError(f"could not read {path}: {exc}") from exc


def read_pooling_config(model_dir: Path | None, config: ModelConfig) -> PoolingConfig:
    """model_dir: the HF checkpoint folder (None for a GGUF file, which carries no such files)."""
    default = PoolingConfig("cls" if config.is_encoder else "last", normalize=True)
    modules_file = None if model_dir is None else model_dir / "modules.json"
    if modules_file is None or not modules_file.is_file():
        return default
    modules = _read(modules_file)
    if not isinstance(modules, list):
        raise UnsupportedModelError(f"{modules_file} is not a list of modules")
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    normalize = "Normalize" in types
    pooling = types.get("Pooling")
    if pooling is None:
        return PoolingConfig(default.mode, normalize)
    settings = _read(Path(model_dir, str(pooling.get("path", "")), "config.json"))  # type: ignore[arg-type]
    if not isinstance(settings, dict):
        raise UnsupportedModelError(f"the Pooling config in {model_dir} is not a JSON object")
    chosen = [mode for key, mode in _ST_POOLING_KEYS.items() if settings.get(key)]
    enabled = [k for k, v in settings.items() if k.startswith("pooling_mode_") and v]
    if len(chosen) != 1 or len(enabled) != 1:
        wanted = ", ".join(enabled) or "none"
        raise UnsupportedModelError(
            f"pooling {wanted} is not supported; radixserve pools by exactly one of mean, cls or last token"
        )
    mode = chosen[0]
    if mode != "last" and not config.is_encoder:
        # A decoder's prompt may be prefilled in chunks or come from the prefix cache, so only the
        # last token's hidden state is sure to be computed.
        raise UnsupportedModelError(f"{mode} pooling on a decoder model is not supported; only last-token")
    return PoolingConfig(mode, normalize)


def pool_segments(hidden: torch.Tensor, segments: list[ExtendSegment], mode: PoolingMode) -> torch.Tensor:
    """hidden: [num_tokens, H] for whole texts laid out by segments. Returns [num_texts, H] in fp32."""
    if mode == "cls":
        rows = torch.tensor([s.q_start for s in segments], device=hidden.device)
        return hidden[rows].float()
    if mode == "last":
        rows = torch.tensor([s.q_start + s.q_len - 1 for s in segments], device=hidden.device)
        return hidden[rows].float()
    owner = torch.repeat_interleave(
        torch.arange(len(segments), device=hidden.device),
        torch.tensor([s.q_len for s in segments], device=hidden.device),
    )
    sums = torch.zeros(len(segments), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, owner, hidden.float())
    lengths = torch.tensor([s.q_len for s in segments], dtype=torch.float32, device=hidden.device)
    return sums / lengths.unsqueeze(1)


def finish_embeddings(pooled: torch.Tensor, pooling: PoolingConfig) -> torch.Tensor:
    return F.normalize(pooled, dim=-1) if pooling.normalize else pooled
