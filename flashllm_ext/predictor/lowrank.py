"""The predictors: a low-rank LowRankPredictor per layer, and the PredictorSet that turns their outputs into active
sets at an operating point."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class LowRankPredictor(nn.Module):
    """Linear(d, r) -> Linear(r, n) on the RMS-normalised input; forward returns logits [N, n].

    The FFN sees its input after an RMS norm, so the predictor normalises too: it then learns a rule that does
    not depend on the residual stream's scale, which drifts across tokens.
    """

    def __init__(self, d: int, n_neurons: int, rank: int):
        super().__init__()
        self.down = nn.Linear(d, rank, bias=False)
        self.up = nn.Linear(rank, n_neurons)

    @property
    def rank(self) -> int:
        return self.down.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.up(self.down(x))


class PredictorSet(nn.Module):
    """One predictor per layer plus the operating point that turns its outputs into an active set.

    thresholds        fp32 [L]: score thresholds defining the true active set (0 for ReLU models)
    prob_thresholds   fp32 [L]: a neuron is predicted active when sigmoid(logit) > this (unless top_k is set)
    top_k             predict the k most likely neurons per token instead
    """

    def __init__(self, predictors: Sequence[LowRankPredictor], thresholds: torch.Tensor,
                 prob_thresholds: torch.Tensor | None = None, top_k: int | None = None):
        super().__init__()
        if thresholds.shape != (len(predictors),):
            raise ValueError(f"need one threshold per predictor ({len(predictors)}), got {tuple(thresholds.shape)}")
        self.predictors = nn.ModuleList(predictors)
        self.top_k = top_k
        self.register_buffer("thresholds", thresholds.float().clone())
        probs = torch.full((len(predictors),), 0.5) if prob_thresholds is None else prob_thresholds.float().clone()
        self.register_buffer("prob_thresholds", probs)

    @torch.no_grad()
    def predict(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """bool [N, n]: neurons predicted active for inputs x [N, d]."""
        logits = self.predictors[layer](x)
        if self.top_k is not None:
            keep = torch.zeros_like(logits, dtype=torch.bool)
            return keep.scatter_(1, logits.topk(min(self.top_k, logits.shape[1]), dim=1).indices, True)
        return torch.sigmoid(logits) > self.prob_thresholds[layer]
