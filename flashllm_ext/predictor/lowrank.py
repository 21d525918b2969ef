"""Low-rank predictors: a LowRankPredictor per layer, as a classifier of the active set (`PredictorSet`, method
"lowrank": 'LLM in a flash', class-balanced BCE, probability thresholds) or as a regression of log|h|
(`RegressionPredictorSet`, method "lowrank-reg": selected by a target density, not a probability)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from flashllm_ext.predictor.base import NeuronPredictor


class LowRankPredictor(nn.Module):
    """Linear(d, r) -> Linear(r, n) on the RMS-normalised input; forward returns [N, n] (logits or log|h|).

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

    @staticmethod
    def features(x: torch.Tensor) -> torch.Tensor:
        """float32 [N, d]: the RMS-normalised input the first projection sees."""
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(self.features(x)))


class _LowRankSet(NeuronPredictor):
    """One LowRankPredictor per layer; scores are their outputs."""

    def __init__(
        self,
        predictors: Sequence[LowRankPredictor],
        thresholds: torch.Tensor | None,
        cutoffs: torch.Tensor | None = None,
    ):
        if not predictors:
            raise ValueError("need at least one predictor")
        first = predictors[0]
        super().__init__(len(predictors), first.down.in_features, first.up.out_features, thresholds, cutoffs)
        self.predictors = nn.ModuleList(predictors)

    @torch.no_grad()
    def scores(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.predictors[layer](x)

    def config(self) -> dict:
        return {**super().config(), "ranks": [p.rank for p in self.predictors]}

    @classmethod
    def _empty(cls, config: dict) -> list[LowRankPredictor]:
        d, n, ranks = int(config["hidden_size"]), int(config["n_neurons"]), [int(r) for r in config["ranks"]]
        if len(ranks) != int(config["n_layers"]):
            raise ValueError(f"{len(ranks)} ranks for {config['n_layers']} layers")
        return [LowRankPredictor(d, n, r) for r in ranks]


class PredictorSet(_LowRankSet):
    """Low-rank classifiers (method "lowrank") plus the operating point that turns their logits into active sets.

    thresholds        fp32 [L]: the rule's thresholds: the true active set, and what the kernel applies
    prob_thresholds   fp32 [L]: a neuron is predicted active when sigmoid(logit) > this (unless top_k is set);
                      set_cutoffs / set_density write it (as sigmoid of the logit cut-off)
    top_k             predict the k most likely neurons per token instead
    """

    method = "lowrank"

    def __init__(
        self,
        predictors: Sequence[LowRankPredictor],
        thresholds: torch.Tensor,
        prob_thresholds: torch.Tensor | None = None,
        top_k: int | None = None,
    ):
        if thresholds.shape != (len(predictors),):
            raise ValueError(f"need one threshold per predictor ({len(predictors)}), got {tuple(thresholds.shape)}")
        super().__init__(predictors, thresholds)
        self.top_k = top_k
        probs = torch.full((len(predictors),), 0.5) if prob_thresholds is None else prob_thresholds.float().clone()
        self.register_buffer("prob_thresholds", probs)

    @torch.no_grad()
    def predict(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        logits = self.scores(layer, x)
        if self.top_k is not None:
            keep = torch.zeros_like(logits, dtype=torch.bool)
            return keep.scatter_(1, logits.topk(min(self.top_k, logits.shape[1]), dim=1).indices, True)
        return torch.sigmoid(logits) > self.prob_thresholds[layer]

    def set_cutoffs(self, cutoffs: torch.Tensor) -> None:
        super().set_cutoffs(cutoffs)
        self.prob_thresholds.copy_(torch.sigmoid(self.cutoffs))
        self.top_k = None

    def config(self) -> dict:
        return {**super().config(), "top_k": self.top_k}

    @classmethod
    def from_config(cls, config: dict) -> PredictorSet:
        top_k = config.get("top_k")
        return cls(
            cls._empty(config), torch.zeros(int(config["n_layers"])), top_k=None if top_k is None else int(top_k)
        )


class RegressionPredictorSet(_LowRankSet):
    """Low-rank regressions of log|h| per neuron (method "lowrank-reg"), fitted in closed form
    (`fit_log_regression`); a neuron is predicted active when its predicted log|h| is above the layer's cut-off,
    chosen for a target density (`set_density`)."""

    method = "lowrank-reg"

    @classmethod
    def from_config(cls, config: dict) -> RegressionPredictorSet:
        return cls(cls._empty(config), None)


def fit_log_regression(
    x: torch.Tensor, scores: torch.Tensor, rank: int, ridge: float = 1e-3, floor: float = 1e-6
) -> LowRankPredictor:
    """Reduced-rank least squares of log(|h| + floor) [N, n] on the RMS-normalised x [N, d]: the full ridge
    solution projected on the top-`rank` directions of its fitted values. Deterministic (no SGD)."""
    if x.dim() != 2 or scores.shape[0] != x.shape[0] or scores.dim() != 2:
        raise ValueError(f"need x [N, d] and scores [N, n], got {tuple(x.shape)}, {tuple(scores.shape)}")
    d, n = x.shape[1], scores.shape[1]
    if not 0 < rank <= min(d, n):
        raise ValueError(f"rank must be in [1, {min(d, n)}], got {rank}")
    z = LowRankPredictor.features(x).double()
    y = torch.log(scores.double() + floor)
    z_mean, y_mean = z.mean(0), y.mean(0)
    zc, yc = z - z_mean, y - y_mean
    gram = zc.T @ zc
    gram.diagonal().add_(ridge * gram.diagonal().mean())
    coef = torch.linalg.solve(gram, zc.T @ yc)  # [d, n]
    # The rank-r projection of the fitted values' row space: B_r = B V_r V_r^T.
    _, _, vh = torch.linalg.svd(zc @ coef, full_matrices=False)
    basis = vh[:rank].T  # [n, r]
    predictor = LowRankPredictor(d, n, rank)
    with torch.no_grad():
        predictor.down.weight.copy_((coef @ basis).T.float())
        predictor.up.weight.copy_(basis.float())
        predictor.up.bias.copy_((y_mean - z_mean @ coef @ basis @ basis.T).float())
    return predictor.eval()
