"""Recording what the predictors learn from: every layer's FFN input and active set (the rule) over a text."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from flashllm_ext.ops.bits import pack_bitmap, unpack_bitmap
from flashllm_ext.hub.hf import decoder_layers, ffn_norm
from flashllm_ext.predictor.rule import activation_score, ffn_hooks, ffn_modules, run_windows


@dataclass
class ActivationCapture:
    """Per layer: predictor inputs fp16 [T, d] and active-neuron bitmaps uint8 [T, ceil(n/8)] (little bit order).

    `scores` holds the raw scores fp32 [T, n] of the layers listed in `keep_scores` only (they are large).
    """

    inputs: list[torch.Tensor]
    bitmaps: list[torch.Tensor]
    n_neurons: int
    thresholds: torch.Tensor
    scores: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask(self, layer: int) -> torch.Tensor:
        """bool [T, n]: neuron active for token."""
        return unpack_bitmap(self.bitmaps[layer], self.n_neurons)

    def density(self, layer: int) -> float:
        return self.mask(layer).float().mean().item()


def capture_activations(
    model: nn.Module,
    token_ids: torch.Tensor,
    thresholds: torch.Tensor,
    window: int = 512,
    keep_scores: Sequence[int] = (),
    progress: bool = True,
    lookahead: bool = False,
) -> ActivationCapture:
    """Record every layer's predictor input and active set (score > threshold) over `token_ids` [T]. lookahead:
    the inputs are what the engine's look-ahead predicts from instead (the FFN's norm of the decoder layer's
    input, before attention: flashllm_ext.flash.engine); the active sets stay the true ones."""
    n_layers = len(ffn_modules(model))
    if thresholds.shape != (n_layers,):
        raise ValueError(f"thresholds must have shape ({n_layers},) (one per layer), got {tuple(thresholds.shape)}")
    inputs: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
    bitmaps: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
    kept: dict[int, list[torch.Tensor]] = {i: [] for i in keep_scores}
    n_neurons = 0

    ahead: dict[int, torch.Tensor] = {}

    def keep_ahead(i: int, norm: nn.Module):
        def hook(_layer, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            ahead[i] = norm(hidden).reshape(-1, hidden.shape[-1])

        return hook

    def record(i, x, h):
        nonlocal n_neurons
        s = activation_score(h)
        n_neurons = s.shape[1]
        inputs[i].append((ahead.pop(i) if lookahead else x).half())
        bitmaps[i].append(pack_bitmap(s > thresholds[i]))
        if i in kept:
            kept[i].append(s.float())

    handles = (
        [
            layer.register_forward_pre_hook(keep_ahead(i, ffn_norm(layer)), with_kwargs=True)
            for i, layer in enumerate(decoder_layers(model))
        ]
        if lookahead
        else []
    )
    try:
        with ffn_hooks(model, record):
            run_windows(model, token_ids, window, progress, "capturing activations")
    finally:
        for handle in handles:
            handle.remove()
    return ActivationCapture(
        [torch.cat(c) for c in inputs],
        [torch.cat(c) for c in bitmaps],
        n_neurons,
        thresholds.clone(),
        {i: torch.cat(c) for i, c in kept.items()},
    )
