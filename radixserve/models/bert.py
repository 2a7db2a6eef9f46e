"""BERT-family encoder (e.g. all-MiniLM-L6-v2): bidirectional attention, post-LayerNorm, GELU MLP.

It only embeds. Every token attends to every other token of its own text, so the K/V of a prefix
depends on what follows it: nothing can be reused across requests and nothing is written to the
KV pool. The scheduler runs encoder requests whole (no chunking) with the prefix cache off.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed.parallel import SINGLE, ParallelContext
from radixserve.forward.batch import ForwardBatch, ForwardMode
from radixserve.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    WeightTarget,
    copy_checked,
)
from radixserve.models.config import ModelConfig


class LayerNorm(nn.LayerNorm):
    def load(self, name: str, tensor: torch.Tensor, shard: int = 0) -> None:
        copy_checked(getattr(self, name).data, tensor, f"LayerNorm {name}")


def _activation(name: str) -> str:
    # HF "gelu" is the exact erf form; the other two are the tanh approximation.
    return "none" if name == "gelu" else "tanh"


class EncoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ctx: ParallelContext):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads // ctx.tp_size
        self.head_dim = config.head_dim
        self.qkv = ColumnParallelLinear(hidden, [hidden] * 3, bias=True, ctx=ctx)
        self.attn_out = RowParallelLinear(hidden, hidden, bias=True, ctx=ctx)
        self.attn_norm = LayerNorm(hidden, eps=config.rms_norm_eps)
        self.intermediate = ColumnParallelLinear(hidden, [config.intermediate_size], bias=True, ctx=ctx)
        self.out = RowParallelLinear(config.intermediate_size, hidden, bias=True, ctx=ctx)
        self.out_norm = LayerNorm(hidden, eps=config.rms_norm_eps)
        self.relu = config.hidden_act == "relu"
        self.gelu_approximate = _activation(config.hidden_act)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        tokens = hidden.shape[0]
        local = self.num_heads * self.head_dim
        q, k, v = self.qkv(hidden).view(tokens, 3, self.num_heads, self.head_dim).unbind(1)
        attn = torch.empty(tokens, self.num_heads, self.head_dim, dtype=hidden.dtype, device=hidden.device)
        assert batch.extend is not None
        for seg in batch.extend:
            rows = slice(seg.q_start, seg.q_start + seg.q_len)
            # [L, H, D] -> [1, H, L, D]; no mask: each text sees all of itself and nothing else.
            qh, kh, vh = (x[rows].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            attn[rows] = F.scaled_dot_product_attention(qh, kh, vh).squeeze(0).transpose(0, 1)
        hidden = self.attn_norm(hidden + self.attn_out(attn.reshape(tokens, local)))
        inner = self.intermediate(hidden)
        inner = F.relu(inner) if self.relu else F.gelu(inner, approximate=self.gelu_approximate)
        out: torch.Tensor = self.out_norm(hidden + self.out(inner))
        return out


# checkpoint module path (under encoder.layer.N.) → ours, and the shard within a stacked layer
_LAYER_NAMES = {
    "attention.self.query": ("qkv", 0),
    "attention.self.key": ("qkv", 1),
    "attention.self.value": ("qkv", 2),
    "attention.output.dense": ("attn_out", 0),
    "attention.output.LayerNorm": ("attn_norm", 0),
    "intermediate.dense": ("intermediate", 0),
    "output.dense": ("out", 0),
    "output.LayerNorm": ("out_norm", 0),
}
_EMBEDDING_NAMES = {
    "word_embeddings": "word",
    "position_embeddings": "position",
    "token_type_embeddings": "token_type",
    "LayerNorm": "norm",
}
_LAYER_PARAM = re.compile(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias)")


class Encoder(nn.Module):
    """forward returns the last layer's hidden states for every token, [num_tokens, hidden]."""

    def __init__(self, config: ModelConfig, max_positions: int, ctx: ParallelContext = SINGLE):
        super().__init__()
        self.config = config
        self.word = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx)
        # Position and segment tables are small: every rank keeps them whole.
        self.position = VocabParallelEmbedding(config.max_position_embeddings, config.hidden_size, SINGLE)
        self.token_type = VocabParallelEmbedding(config.type_vocab_size, config.hidden_size, SINGLE)
        self.norm = LayerNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(config, ctx) for _ in range(config.num_hidden_layers))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if batch.mode is not ForwardMode.EXTEND or any(seg.prefix_len for seg in batch.extend or []):
            raise ValueError("an encoder runs whole texts only: no decode steps, no cached prefix")
        # Single-segment inputs: every token has token type 0.
        hidden = self.word(batch.input_ids) + self.position(batch.positions) + self.token_type.weight[0]
        hidden = self.norm(hidden)
        for layer in self.layers:
            hidden = layer(hidden, batch)
        result: torch.Tensor = hidden
        return result

    def resolve(self, name: str) -> WeightTarget:
        if match := _LAYER_PARAM.fullmatch(name):
            index, module_name, param = match.groups()
            ours, shard = _LAYER_NAMES.get(module_name, ("", 0))
            path = f"layers.{index}.{ours}"
        else:
            prefix, _, param = name.removeprefix("embeddings.").rpartition(".")
            path, shard = _EMBEDDING_NAMES.get(prefix, ""), 0
        module = dict(self.named_modules()).get(path)
        if not path or module is None:
            raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
        return WeightTarget(path, module, param, shard)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            self.resolve(name).load(tensor)
