"""A mixture-of-experts layer's resident parts on the lean decoder: the router, which names each token's experts and
their weights exactly (so flashllm_ext.flash.experts reads only those), and Qwen2-MoE's shared expert.

Routing as transformers computes it for Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE: softmax over the router's logits
in float32, the top_k largest probabilities, renormalised to sum to 1 where the config says (norm_top_k).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashllm_ext.decoder.config import DecoderConfig
from flashllm_ext.decoder.layers import ResidentWeights, linear
from flashllm_ext.ops import ACTIVATIONS

# The router's name under each family's layer (Mixtral's block_sparse_moe, the others' mlp)
ROUTER_NAMES = ("block_sparse_moe.gate.weight", "mlp.gate.weight")


class Router:
    """Layer `index`'s router [n_experts, d]: route(x [T, d] float32) -> (experts int64 [T, top_k], their weights
    float32 [T, top_k]), each row's experts in descending order of weight."""

    def __init__(self, config: DecoderConfig, weights: ResidentWeights, index: int):
        found = [w for w in (weights.get(f"layers.{index}.{name}") for name in ROUTER_NAMES) if w is not None]
        if len(found) != 1:
            raise ValueError(f"{weights.store.path}: layer {index} needs one router among {ROUTER_NAMES}")
        self.weight = found[0]
        if tuple(self.weight.shape) != (config.n_experts, config.hidden_size):
            raise ValueError(
                f"{weights.store.path}: layer {index}'s router has shape {tuple(self.weight.shape)}, expected "
                f"{(config.n_experts, config.hidden_size)}"
            )
        self.top_k, self.normalise = config.top_k, config.norm_top_k

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probabilities = torch.softmax(linear(x, self.weight), dim=-1)
        weights, experts = torch.topk(probabilities, self.top_k, dim=-1)
        if self.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights


class SharedExpert:
    """Qwen2-MoE's shared expert: a dense SwiGLU FFN every token runs, scaled by sigmoid(gate x)."""

    def __init__(self, config: DecoderConfig, weights: ResidentWeights, index: int):
        prefix = f"layers.{index}.mlp.shared_expert"
        self.gate_up = torch.cat([weights.require(f"{prefix}.{name}_proj.weight") for name in ("gate", "up")])
        self.down = weights.require(f"{prefix}.down_proj.weight")
        self.scale = weights.require(f"{prefix}_gate.weight")
        self.activation = ACTIVATIONS[config.hidden_act].fn

    def tensors(self) -> list[torch.Tensor]:
        return [self.gate_up, self.down, self.scale]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up).chunk(2, dim=-1)
        return F.sigmoid(linear(x, self.scale)) * linear(self.activation(gate) * up, self.down)
