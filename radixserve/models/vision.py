"""LLaVA's image encoder: a CLIP vision tower and the MLP projector into the text model's
embedding space.

Images are encoded once, whole, before the prompt that holds them is prefilled; their
embeddings then take the place of the prompt's image tokens. Plain torch ops suffice: the
tower runs once per image, not once per generated token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.linear import copy_checked
from radixserve.models.config import VisionConfig

__all__ = ["VisionTower"]


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    # CLIP's sigmoid approximation of GELU (what OpenAI's CLIP was trained with).
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# Covers config.VISION_TOWER_ACTIVATIONS and config.VISION_PROJECTOR_ACTIVATIONS.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": _quick_gelu,
    "gelu": F.gelu,  # HF "gelu" is the exact erf form
    "gelu_pytorch_tanh": _gelu_tanh,
    "relu": F.relu,
    "silu": F.silu,
}


def layers_used(config: VisionConfig) -> int:
    """How many encoder layers produce the hidden state that feature_layer selects."""
    k = config.feature_layer
    return k if k >= 0 else config.num_hidden_layers + 1 + k


class _Embeddings(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        grid = config.image_size // config.patch_size
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.patch_embedding = nn.Conv2d(
            config.num_channels, config.hidden_size, config.patch_size, stride=config.patch_size, bias=False
        )
        self.position_embedding = nn.Embedding(grid * grid + 1, config.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [n, grid*grid, hidden]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        out: torch.Tensor = torch.cat([cls, patches], dim=1) + self.position_embedding.weight
        return out


class _Attention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, seq, hidden = x.shape
        q, k, v = (
            p(x).view(n, seq, self.num_heads, -1).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        # Non-causal: every patch (and the CLS token) sees the whole image.
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, seq, hidden)
        out: torch.Tensor = self.out_proj(attn)
        return out


class _MLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.act(self.fc1(x)))
        return out


class _EncoderLayer(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = _Attention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = _MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        out: torch.Tensor = x + self.mlp(self.layer_norm2(x))
        return out


class _Encoder(nn.Module):
    def __init__(self, config: VisionConfig, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(_EncoderLayer(config) for _ in range(num_layers))


class _Tower(nn.Module):
    """CLIP vision model, with parameter names as in HF's CLIPVisionModel (minus the unused
    post_layernorm, and minus the layers after the selected one)."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.embeddings = _Embeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = _Encoder(config, layers_used(config))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x: torch.Tensor = self.pre_layrnorm(self.embeddings(pixels))
        for layer in self.encoder.layers:
            x = layer(x)
        return x


class _Projector(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        bias = config.projector_bias
        self.linear_1 = nn.Linear(config.hidden_size, config.text_hidden_size, bias=bias)
        self.linear_2 = nn.Linear(config.text_hidden_size, config.text_hidden_size, bias=bias)
        self.act = _ACTIVATIONS[config.projector_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear_2(self.act(self.linear_1(x)))
        return out


class VisionTower(nn.Module):
    """Pixels -> image embeddings for the text model (built under the caller's default dtype
    and device, with placeholder weights until load_weights fills them)."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.tower = _Tower(config)
        self.projector = _Projector(config)
        self.requires_grad_(False)  # inference only

    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[n, channels, image_size, image_size] -> [n, tokens_per_image, text_hidden_size]."""
        c = self.config
        expected = [c.num_channels, c.image_size, c.image_size]
        if pixel_values.dim() != 4 or list(pixel_values.shape[1:]) != expected:
            shape = list(pixel_values.shape)
            raise ValueError(f"pixel_values must have shape [n, *{expected}], got {shape}")
        weight = self.projector.linear_1.weight
        with torch.inference_mode():
            hidden = self.tower(pixel_values.to(device=weight.device, dtype=weight.dtype))
            if c.select_strategy == "default":
                hidden = hidden[:, 1:]
            out: torch.Tensor = self.projector(hidden)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load ``tower.<HF CLIPVisionModel name>`` and ``projector.<name>`` tensors; every
        parameter must be given exactly once, and nothing unknown."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unknown: list[str] = []
        with torch.no_grad():
            for name, tensor in weights:
                if name in params:
                    copy_checked(params[name], tensor, f"vision {name}")
                    loaded.add(name)
                elif not self._skippable(name):
                    unknown.append(name)
        if unknown:
            raise KeyError(f"unknown vision tensors: {', '.join(sorted(unknown)[:5])}")
        missing = sorted(set(params) - loaded)
        if missing:
            raise KeyError(f"missing vision tensors: {', '.join(missing[:5])}")

    def _skippable(self, name: str) -> bool:
        # LLaVA reads hidden states, never the pooled output that post_layernorm normalises; and
        # the layers after the selected one do not contribute to it.
        if name.startswith("tower.post_layernorm."):
            return True
        prefix = "tower.encoder.layers."
        if not name.startswith(prefix):
            return False
        index = name[len(prefix) :].split(".", 1)[0]
        return index.isdigit() and layers_used(self.config) <= int(index) < self.config.num_hidden_layers
