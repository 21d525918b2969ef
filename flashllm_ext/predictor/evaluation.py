"""Measuring predictors: the patched FFN (inactive neurons zeroed, for perplexity) and `evaluate` (recall,
precision, density, false-negative mass per layer; perplexity dense / threshold / threshold + predictor)."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..models.text import perplexity
from .lowrank import PredictorSet
from .rule import activation_score, ffn_hooks, ffn_modules, run_windows


@dataclass
class SparsityCounter:
    """Kept / total (token, neuron) pairs per layer while a patch is active."""
    kept: list[int]
    total: list[int]

    @property
    def sparsity(self) -> float:
        return 1.0 - sum(self.kept) / max(1, sum(self.total))


@contextmanager
def patched_ffn(model: nn.Module, thresholds: torch.Tensor,
                predictors: PredictorSet | None = None) -> Iterator[SparsityCounter]:
    """Within the block, every FFN zeroes the neurons that are not active: score <= threshold, or (with
    predictors) not predicted active. Yields the achieved sparsity counter."""
    n_layers = len(ffn_modules(model))
    if thresholds.shape != (n_layers,):
        raise ValueError(f"thresholds must have shape ({n_layers},), got {tuple(thresholds.shape)}")
    if predictors is not None and len(predictors.predictors) != n_layers:
        raise ValueError(f"model has {n_layers} FFN layers, predictors cover {len(predictors.predictors)}")
    counter = SparsityCounter([0] * n_layers, [0] * n_layers)

    def sparsify(i, x, h):
        keep = activation_score(h) > thresholds[i]
        if predictors is not None:
            keep &= predictors.predict(i, x)
        counter.kept[i] += int(keep.sum())
        counter.total[i] += keep.numel()
        return h * keep

    with ffn_hooks(model, sparsify):
        yield counter


@torch.no_grad()
def evaluate(model: nn.Module, predictors: PredictorSet, token_ids: torch.Tensor, window: int = 512,
             n_windows: int = 4, progress: bool = True) -> dict:
    """Predictor quality on held-out `token_ids` and end-to-end perplexity.

    Returns {"layers": [{layer, rank, recall, precision, density, true_density, fn_mass}], "ppl_dense",
    "ppl_threshold", "ppl_predictor", "sparsity_threshold", "sparsity"}. Per-layer figures are measured on the
    dense model's activations; `density` is the predicted (loaded) fraction, `fn_mass` the share of the active
    neurons' |score| mass that false negatives lose; `sparsity` the FFN sparsity with predictor and threshold.
    """
    n_tokens = window * n_windows
    ids = token_ids[:n_tokens]
    n_layers = len(predictors.predictors)
    sums = torch.zeros(n_layers, 5, dtype=torch.float64)  # tp, fp, fn, fn mass, active mass

    def measure(i, x, h):
        s = activation_score(h)
        true = s > predictors.thresholds[i]
        pred = predictors.predict(i, x)
        sums[i] += torch.tensor([(true & pred).sum().item(), (~true & pred).sum().item(),
                                 (true & ~pred).sum().item(), s[true & ~pred].sum().item(), s[true].sum().item()],
                                dtype=torch.float64)

    with ffn_hooks(model, measure):
        run_windows(model, ids, window, progress, "evaluating predictors")
    layers = []
    n_neurons = predictors.predictors[0].up.out_features
    for i, (tp, fp, fn, fn_mass, mass) in enumerate(sums.tolist()):
        layers.append({"layer": i, "rank": predictors.predictors[i].rank, "recall": tp / max(tp + fn, 1),
                       "precision": tp / max(tp + fp, 1), "density": (tp + fp) / (ids.numel() * n_neurons),
                       "true_density": (tp + fn) / (ids.numel() * n_neurons), "fn_mass": fn_mass / max(mass, 1e-30)})
    ppl_dense = perplexity(model, ids, window, n_windows, progress)
    with patched_ffn(model, predictors.thresholds) as threshold_only:
        ppl_threshold = perplexity(model, ids, window, n_windows, progress)
    with patched_ffn(model, predictors.thresholds, predictors) as with_predictor:
        ppl_predictor = perplexity(model, ids, window, n_windows, progress)
    return {"layers": layers, "ppl_dense": ppl_dense, "ppl_threshold": ppl_threshold,
            "ppl_predictor": ppl_predictor, "sparsity_threshold": threshold_only.sparsity,
            "sparsity": with_predictor.sparsity}
