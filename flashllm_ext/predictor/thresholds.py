"""Per-layer thresholds on the active-neuron rule's score, calibrated to a target sparsity (SwiGLU has no exact
zeros; ReLU layers keep theirs)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from flashllm_ext.predictor.rule import activation_score, ffn_hooks, run_windows


def calibrate_thresholds(
    model: nn.Module,
    token_ids: torch.Tensor,
    target: float | Sequence[float] = 0.5,
    window: int = 512,
    progress: bool = True,
) -> torch.Tensor | dict[float, torch.Tensor]:
    """Per-layer thresholds on the rule's score so that a fraction `target` of (token, neuron) scores lies at or
    below.

    Returns fp32 [L] for one target, or {target: [L]} for several (one forward pass serves all).
    ReLU layers whose natural sparsity already exceeds a target get threshold 0 (exact zeros only).
    """
    targets = [target] if isinstance(target, (int, float)) else list(target)
    if not targets or not all(0.0 <= t < 1.0 for t in targets):
        raise ValueError(f"targets must be in [0, 1), got {target}")
    scores: dict[int, list[torch.Tensor]] = {}

    def collect(i, x, h):
        # fp16 halves the memory of the kept scores; a threshold does not need more precision.
        scores.setdefault(i, []).append(activation_score(h).half())

    with ffn_hooks(model, collect):
        run_windows(model, token_ids, window, progress, "calibrating thresholds")
    result = {t: torch.zeros(len(scores)) for t in targets}
    for i, chunks in scores.items():
        flat = torch.cat(chunks).flatten().float()
        for t in targets:
            k = int(round(t * flat.numel()))
            result[t][i] = flat.kthvalue(k).values if k > 0 else 0.0
    return result[targets[0]] if isinstance(target, (int, float)) else result
