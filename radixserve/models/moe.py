"""Mixture-of-Experts feed-forward layers (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE): a router picks
each token's top-k experts, and each expert runs once per step on the rows routed to it. Qwen2-MoE
adds a shared expert every token takes, its output scaled by sigmoid(shared_expert_gate · x) and
added after the routed experts'.

The router's probabilities are a softmax in fp32 over every expert, of which each token keeps its
top k (renormalized to sum to 1 where the config says so, norm_topk_prob); a token's output is the
sum of its experts' SwiGLU outputs weighted by those probabilities, added in expert order. Experts
no row of the step routes to are not read. fp32 rows on a CPU with the native kernels are routed
natively (csrc/moe.cpp: the router on fp32_linear, then softmax and top-k), as the fused decode
loop routes them (models/fused_decode.py), so that the two agree bit for bit.

Dense experts are stacked per layer and run on torch ops. An expert whose gate, up and down come in
GGUF blocks (a GGUF, or --quantization) keeps them (models/moe_experts.py): its gate and up rows as
one quantized weight of two parts, each in its own format (gate first, as silu_and_mul takes them),
its down as another, each packed once for the native quantized kernel, which multiplies the rows
routed to it; the shared expert alike. When every expert of the layer is held so, one native call
runs a step's (QuantKernels.moe: the rows grouped by expert, one parallel region per projection for
all of them, and their weighted sum in fp32), with the numbers each row would get from its expert
alone. A stacked tensor whose
every expert is quantized is freed. A weight one of whose parts comes dense (a format without a
kernel, dequantized at load) is held dense, the other part dequantized; so is one a dense tensor
replaces (/update_weights_from_tensor), as a dense linear is after an update. The router and the
shared expert's gate stay dense. Without the quantized kernel (a CUDA device, --cpu-kernels torch)
quantized tensors are dequantized at load.

With --tp-size N every rank holds every expert, each cut along its intermediate dimension: its
gate_up keeps this rank's slice of the gate rows, then the same slice of the up rows, its down the
same slice of the columns; the shared expert is cut alike. A quantized down is cut along whole
blocks of its format only (32 or 256 columns), else loading fails with QuantizationError. The
router and the shared expert's gate are copied to every rank, so every rank routes every token the
same way. Each rank sums its slices' outputs (routed and shared), and one all-reduce per layer adds
the ranks' partial sums, as the dense MLP's row-parallel down does. The intermediate sizes must
divide by N. /get_weights_by_name reads an expert's tensor whole (the ranks' slices gathered,
quantized ones dequantized), under the checkpoint's name.

While recording (/start_expert_distribution_record), each layer counts the tokens routed to each
expert: a token that picks k experts counts once for each of them. Under tensor parallelism every
rank counts the same routing; the counts answered are rank 0's (control answers are), not a sum.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed.parallel import ParallelContext, all_reduce, gather_shards
from radixserve.kernels.cpu_ops import CpuKernels
from radixserve.layers.activation import silu_and_mul
from radixserve.layers.linear import copy_checked, divide
from radixserve.layers.quantized import QuantizedTensor, WeightTensor
from radixserve.models.config import ModelConfig
from radixserve.models.moe_experts import ExpertStore

# A checkpoint tensor of the layer, as named under its `mlp.`: the router, or one expert's linear.
_PARAM = re.compile(
    r"^(?:gate\.weight|experts\.(\d+)\.(gate|up|down)_proj\.weight"
    r"|shared_expert\.(gate|up|down)_proj\.weight|shared_expert_gate\.weight)$"
)


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, ctx: ParallelContext, kernels: CpuKernels | None):
        super().__init__()
        experts, hidden = config.num_experts, config.hidden_size
        # This rank's slice of each expert's (and the shared expert's) intermediate dimension.
        size = divide(config.moe_intermediate_size, ctx.tp_size, "the experts' intermediate size")
        shared = divide(
            config.shared_expert_intermediate_size, ctx.tp_size, "the shared expert's intermediate size"
        )
        self.ctx = ctx
        self.kernels = kernels
        self.top_k = config.num_experts_per_tok
        self.normalize = config.norm_topk_prob
        self.size = size
        self.router = nn.Parameter(torch.empty(experts, hidden), requires_grad=False)
        # Each expert's gate and up rows stacked (gate first, as silu_and_mul takes them), and its down.
        self.gate_up = nn.Parameter(torch.empty(experts, 2 * size, hidden), requires_grad=False)
        self.down = nn.Parameter(torch.empty(experts, hidden, size), requires_grad=False)
        self.shared_size = shared
        self.shared_gate_up = nn.Parameter(torch.empty(2 * shared, hidden), requires_grad=False)
        self.shared_down = nn.Parameter(torch.empty(hidden, shared), requires_grad=False)
        self.shared_gate = nn.Parameter(torch.empty(1 if shared else 0, hidden), requires_grad=False)
        # The experts kept in GGUF blocks, and how many of each stacked tensor's (by its name).
        self.held = ExpertStore(kernels.quant if kernels is not None else None, self.router.dtype)
        self.quantized_count: dict[str, int] = {}
        # Tokens routed to each expert since the recording started (None while not recording), and
        # the last recording's once it stopped.
        self.routed: torch.Tensor | None = None
        self.counted: torch.Tensor | None = None

    @staticmethod
    def checkpoint_names(config: ModelConfig) -> list[str]:
        """The tensors a checkpoint holds for one sparse layer, under its `mlp.`."""
        names = ["gate.weight"]
        for e in range(config.num_experts):
            names += [f"experts.{e}.{proj}_proj.weight" for proj in ("gate", "up", "down")]
        if config.shared_expert_intermediate_size:
            names += [f"shared_expert.{proj}_proj.weight" for proj in ("gate", "up", "down")]
            names.append("shared_expert_gate.weight")
        return names

    def load(self, name: str, tensor: WeightTensor, shard: int = 0) -> None:
        """A checkpoint tensor (whole, as the checkpoint holds it): this rank copies out its slice."""
        match = _PARAM.match(name)
        if match is None:
            raise KeyError(f"a Mixture-of-Experts layer has no tensor {name!r}")
        with torch.no_grad():
            if match.group(1) is None and match.group(3) is None:
                # The router and the shared expert's gate are never kept quantized.
                plain = tensor.dequantize() if isinstance(tensor, QuantizedTensor) else tensor
                target = self.shared_gate if name == "shared_expert_gate.weight" else self.router
                copy_checked(target.data, plain, name)
            elif match.group(3) is not None:
                self._load_slice(None, match.group(3), tensor, name)
            else:
                self._load_slice(int(match.group(1)), match.group(2), tensor, name)

    def _load_slice(self, expert: int | None, proj: str, tensor: WeightTensor, name: str) -> None:
        """This rank's slice of one expert's gate, up (rows) or down (columns) projection (expert
        None: the shared expert's), copied into the stacked dense tensors or kept quantized."""
        local = self.size if expert is not None else self.shared_size
        full, start = local * self.ctx.tp_size, local * self.ctx.tp_rank
        hidden = self.router.shape[1]
        expected = (hidden, full) if proj == "down" else (full, hidden)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name}: expected shape {expected}, got {tuple(tensor.shape)}")
        piece: WeightTensor
        if isinstance(tensor, QuantizedTensor) and self.held.kernels is not None:
            # A down shard along whole blocks only (QuantizationError says so otherwise).
            piece = tensor.narrow_cols(start, local) if proj == "down" else tensor.narrow_rows(start, local)
        else:
            plain = tensor.dequantize() if isinstance(tensor, QuantizedTensor) else tensor
            piece = plain.narrow(1 if proj == "down" else 0, start, local)
        kind = "down" if proj == "down" else "gate_up"
        stacked = kind if expert is not None else f"shared_{kind}"
        key = stacked if expert is None else f"{kind}_{expert}"
        part, count = (0, 1) if proj == "down" else (0 if proj == "gate" else 1, 2)

        def dense(index: int) -> torch.Tensor:
            """Where part `index` goes in the stacked dense tensor."""
            slot: torch.Tensor = getattr(self, stacked).data
            slot = slot if expert is None else slot[expert]
            return slot if count == 1 else slot[index * local : (index + 1) * local]

        if self.held.take(key, part, count, piece, dense, name):
            # Every expert of the stacked tensor quantized: its dense copy is not read again.
            self.quantized_count[stacked] = self.quantized_count.get(stacked, 0) + 1
            if self.quantized_count[stacked] == (self.router.shape[0] if expert is not None else 1):
                dtype = getattr(self, stacked).dtype
                setattr(self, stacked, nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False))

    def held_linears(self, name: str) -> list[nn.Module]:
        """The quantized expert linear a checkpoint tensor of the layer writes into, if it is held
        so: an update turns it dense first, so that a failed update can put its values back."""
        match = _PARAM.match(name)
        if match is None or (match.group(1) is None and match.group(3) is None):
            return []
        kind = "down" if (match.group(3) or match.group(2)) == "down" else "gate_up"
        held = self.held.get(f"shared_{kind}" if match.group(3) is not None else f"{kind}_{match.group(1)}")
        return [] if held is None else [held]

    def read(self, name: str) -> torch.Tensor:
        """A checkpoint tensor as the checkpoint holds it (/get_weights_by_name): under tensor
        parallelism every rank calls this together, and the ranks' slices are gathered."""
        match = _PARAM.match(name)
        if match is None:
            raise KeyError(f"a Mixture-of-Experts layer has no tensor {name!r}")
        if name == "shared_expert_gate.weight":
            return self.shared_gate.detach()
        if match.group(1) is None and match.group(3) is None:
            return self.router.detach()
        if self.router.numel() == 0:
            raise KeyError(f"{name} is not in memory now (released by /release_memory_occupation)")
        proj = match.group(3) or match.group(2)
        expert = None if match.group(3) is not None else int(match.group(1))
        kind = "down" if proj == "down" else "gate_up"
        held = self.held.get(f"shared_{kind}" if expert is None else f"{kind}_{expert}")
        weight: torch.Tensor
        if held is not None:
            weight = held.dense_weight()
        else:
            weight = getattr(self, kind if expert is not None else f"shared_{kind}")
            weight = weight if expert is None else weight[expert]
        local = self.size if expert is not None else self.shared_size
        part: torch.Tensor
        if proj == "down":
            part, dim = weight, 1
        else:
            part, dim = weight[(0 if proj == "gate" else local) :][:local], 0
        if self.ctx.tp_size == 1:
            return part.detach()
        ctx = self.ctx
        return gather_shards(part.contiguous(), dim, local * ctx.tp_rank, local * ctx.tp_size, ctx).detach()

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The layer's output added to residual."""
        chosen, weights = self.route(x)
        if self.routed is not None:
            self.routed += torch.bincount(chosen.flatten(), minlength=self.routed.shape[0])
        held = self.held
        tables = held.tables(self.router.shape[0])
        if tables is not None:
            # Every expert in blocks: one native call routes the rows, runs the experts they picked
            # and adds their weighted outputs.
            assert held.kernels is not None
            out = held.kernels.moe(tables, chosen, weights, x, self.size)
        else:
            out = self._experts_one_by_one(x, chosen, weights)
        if self.shared_size:
            out = self._add_shared_expert(x, out)
        # This rank's slices' share of the output: the ranks' shares summed (one collective a layer).
        return all_reduce(out, self.ctx) + residual

    def _add_shared_expert(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out plus the shared expert's output scaled by sigmoid(shared_gate . x): in one native
        call for fp32 rows with it held in blocks (csrc/moe.cpp, which the fused decode loop calls
        too), else on torch ops."""
        held = self.held
        layouts = held.shared_layouts()
        if layouts is not None and held.kernels is not None and x.dtype == torch.float32:
            return held.kernels.moe_shared_(layouts, self.shared_gate, x, out.contiguous(), self.shared_size)
        gate_up, down = held.get("shared_gate_up"), held.get("shared_down")
        up = F.linear(x, self.shared_gate_up) if gate_up is None else gate_up(x)
        hidden = silu_and_mul(up, self.kernels)
        shared = F.linear(hidden, self.shared_down) if down is None else down(hidden)
        return out + torch.sigmoid(F.linear(x, self.shared_gate)) * shared

    @property
    def row_invariant(self) -> bool:
        """Whether a row's output never depends on the other rows of its step: fp32 rows routed on
        the native kernels, every expert (a shared one too) in blocks on the row-invariant
        quantized kernel."""
        return (
            self.kernels is not None
            and self.held.kernels is not None
            and self.router.dtype == torch.float32
            and (self.shared_size == 0 or self.held.shared_layouts() is not None)
            and self.held.tables(self.router.shape[0]) is not None
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k experts (largest probability first) and their probabilities in fp32:
        natively for fp32 rows on a CPU with the quantized kernels (csrc/moe.cpp, which the fused
        decode loop calls too), else on torch ops."""
        quant = self.held.kernels
        if quant is not None and self.kernels is not None and x.dtype == torch.float32:
            return quant.moe_route(self.kernels.fp32_linear(x, self.router), self.top_k, self.normalize)
        probabilities = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, chosen = probabilities.topk(self.top_k, dim=-1)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return chosen, weights

    def _experts_one_by_one(
        self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The routed output with each expert a matmul of its own (some expert is dense), each
        row's experts added in ascending order, as QuantKernels.moe adds them (in x's dtype)."""
        out = torch.zeros_like(x)
        weights = weights.to(x.dtype)
        for expert in torch.unique(chosen).tolist():
            rows, slot = torch.where(chosen == expert)
            gate_up, down = self.held.get(f"gate_up_{expert}"), self.held.get(f"down_{expert}")
            picked = x[rows]
            up = F.linear(picked, self.gate_up[expert]) if gate_up is None else gate_up(picked)
            hidden = silu_and_mul(up, self.kernels)
            result = F.linear(hidden, self.down[expert]) if down is None else down(hidden)
            out.index_add_(0, rows, result * weights[rows, slot, None])
        return out


def sparse_layers(model: nn.Module) -> dict[int, SparseMoE]:
    """The model's Mixture-of-Experts layers by layer index."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, SparseMoE):
            found[int(name.split(".")[-2])] = module
    return found


def record_experts(model: nn.Module, recording: bool) -> None:
    """Starts counting routed tokens from zero in every sparse layer, or stops (the counts stay)."""
    for layer in sparse_layers(model).values():
        if recording:
            layer.routed = torch.zeros(layer.router.shape[0], dtype=torch.int64, device=layer.router.device)
        elif layer.routed is not None:
            layer.counted = layer.routed
            layer.routed = None


def expert_counts(model: nn.Module) -> dict[int, list[int]]:
    """Per sparse layer, the tokens routed to each expert in the last (or current) recording."""
    counts = {}
    for index, layer in sorted(sparse_layers(model).items()):
        tally = layer.routed if layer.routed is not None else layer.counted
        counts[index] = [] if tally is None else tally.tolist()
    return counts
