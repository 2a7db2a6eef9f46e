"""Which class runs each architecture.

Extension point: a new model family is a module in models/ with its nn.Module, registered here
under the HF architecture names it serves (and listed in models/config.py's
SUPPORTED_ARCHITECTURES, which the config loader accepts). A decoder that can run its decode steps
in the fused native loop declares it with a `fused_decode_plan()` method, as the Llama family does.
"""

from __future__ import annotations

from radixserve.distributed.parallel import ParallelContext
from radixserve.kernels.cpu_ops import CpuKernels
from radixserve.models.bert import Encoder
from radixserve.models.config import ModelConfig, UnsupportedModelError
from radixserve.models.gemma3 import Gemma3CausalLM
from radixserve.models.llama import CausalLM

# Decoders: built with the native CPU kernels they may use.
DECODER_MODELS: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": CausalLM,
    "MistralForCausalLM": CausalLM,
    "Qwen2ForCausalLM": CausalLM,
    "Qwen3ForCausalLM": CausalLM,
    # Llama's layers; its fused qkv_proj / gate_up_proj tensors are split at load (models/loader.py).
    "Phi3ForCausalLM": CausalLM,
    # Qwen3's layers with Mixture-of-Experts feed-forwards where the config says (models/moe.py).
    "Qwen3MoeForCausalLM": CausalLM,
    # Qwen2's layers (q/k/v bias) with experts and a gated shared expert (models/moe.py).
    "Qwen2MoeForCausalLM": CausalLM,
    # Mistral's layers, each with experts (their checkpoint names mapped by models/loader.py).
    "MixtralForCausalLM": CausalLM,
    # Experts in every layer; q/k norms over the whole projection, clip_qkv.
    "OlmoeForCausalLM": CausalLM,
    # Four norms per layer, GELU, sliding and global layers with a rotary base each (models/gemma3.py).
    "Gemma3ForCausalLM": Gemma3CausalLM,
}
# Bidirectional encoders: embeddings only, no KV cache; torch ops only.
ENCODER_MODELS: dict[str, type[Encoder]] = {"BertModel": Encoder}


def build_model(
    config: ModelConfig, max_positions: int, parallel: ParallelContext, kernels: CpuKernels | None
) -> CausalLM | Encoder:
    """The model for config.architecture, with uninitialized weights (built under the caller's
    default dtype and device)."""
    if config.architecture in ENCODER_MODELS:
        return ENCODER_MODELS[config.architecture](config, max_positions, parallel)
    if config.architecture in DECODER_MODELS:
        return DECODER_MODELS[config.architecture](config, max_positions, parallel, kernels)
    raise UnsupportedModelError(f"no model class is registered for {config.architecture}")
