"""A mixture-of-experts store in a transformers model (load_flash): each layer's sparse block keeps its own router
(and Qwen2-MoE's shared expert), so routing is exactly transformers'; only its `experts` module is replaced, by
StoreExperts, which computes the experts the router named from flashllm_ext.flash.experts' cache (dense, naive or
flash mode, within the budget).

The four families transformers 5 builds this way (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) call
`block.experts(hidden [T, d], top_k_index [T, k], top_k_weights [T, k])`; StoreExperts answers that call.
"""

from __future__ import annotations

import torch
from torch import nn

from flashllm_ext.flash.experts import ExpertFFN, expert_stack
from flashllm_ext.flash.stack import FlashRuntime
from flashllm_ext.flash.store import FlashStore

# the routed experts' blocks in transformers' decoder layers, by the attribute that holds them
BLOCK_ATTRIBUTES = ("mlp", "block_sparse_moe")


class StoreExperts(nn.Module):
    """One layer's experts served by an ExpertFFN: the block's `experts` call with the block's routing."""

    def __init__(self, ffn: ExpertFFN):
        super().__init__()
        self.ffn = ffn

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, d] (the model's dtype), top_k_index int64 [T, k], top_k_weights [T, k] -> [T, d]."""
        out = self.ffn.routed(hidden.float(), top_k_index, top_k_weights.float())
        return out.to(hidden.dtype)


def _unrouted(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    raise RuntimeError("the block's own router routes these experts: ExpertFFN.routed, not ExpertFFN(x)")


def expert_blocks(model: nn.Module) -> list[nn.Module]:
    """Each decoder layer's sparse block (its `experts` and `gate`); ValueError when a layer has none."""
    blocks = []
    for i, layer in enumerate(model.model.layers):
        block = next((getattr(layer, a) for a in BLOCK_ATTRIBUTES if hasattr(getattr(layer, a, None), "experts")), None)
        if block is None:
            raise ValueError(f"{type(model).__name__} layer {i} has no mixture-of-experts block")
        if isinstance(block.experts, nn.ModuleList):  # transformers 4's experts, called one at a time
            raise ValueError(f"{type(model).__name__}: serving its experts from a store needs transformers >= 5")
        blocks.append(block)
    return blocks


def install_experts(
    model: nn.Module,
    store: FlashStore,
    mode: str,
    budget_bytes: int | None,
    *,
    resident_bytes: int,
    policy: str,
    window: int,
    threads: int,
    reader_options: dict | None,
) -> FlashRuntime:
    """Every MoE block's experts of `model` (its other tensors resident already) served from `store` by `mode`
    (EXPERT_MODES) within `budget_bytes`, of which `resident_bytes` are the model's own; returns the runtime."""
    blocks = expert_blocks(model)
    if len(blocks) != store.n_layers:
        raise ValueError(f"{type(model).__name__} has {len(blocks)} layers, the store {store.path} {store.n_layers}")
    runtime = expert_stack(
        store,
        mode,
        budget_bytes,
        routes=[_unrouted] * store.n_layers,
        top_k=int(model.config.num_experts_per_tok),
        policy=policy,
        window=window,
        threads=threads,
        resident_bytes=resident_bytes,
        reader_options=reader_options,
    )
    for block, ffn in zip(blocks, runtime.modules):
        block.experts = StoreExperts(ffn)
    runtime.install_on(model)
    return runtime
