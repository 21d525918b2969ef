"""Measuring predictors: the patched FFN (inactive neurons zeroed, for perplexity), `evaluate` (recall,
precision, density, false-negative mass per layer; perplexity dense / threshold / threshold + predictor) and
`operating_point` (one pass: perplexity with the predictor, loaded density and recall of the true active set and of
its output mass, per layer)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from flashllm_ext.hub.text import perplexity
from flashllm_ext.predictor.base import NeuronPredictor
from flashllm_ext.predictor.rule import activation_score, ffn_hooks, ffn_modules, input_weight_share, run_windows


@dataclass
class SparsityCounter:
    """Kept / total (token, neuron) pairs per layer while a patch is active."""

    kept: list[int]
    total: list[int]

    @property
    def sparsity(self) -> float:
        return 1.0 - sum(self.kept) / max(1, sum(self.total))


@contextmanager
def patched_ffn(
    model: nn.Module, thresholds: torch.Tensor, predictors: NeuronPredictor | None = None
) -> Iterator[SparsityCounter]:
    """Within the block, every FFN zeroes the neurons that are not active: score <= threshold, or (with
    predictors) not predicted active. Yields the achieved sparsity counter."""
    n_layers = len(ffn_modules(model))
    if thresholds.shape != (n_layers,):
        raise ValueError(f"thresholds must have shape ({n_layers},), got {tuple(thresholds.shape)}")
    if predictors is not None and predictors.n_layers != n_layers:
        raise ValueError(f"model has {n_layers} FFN layers, predictors cover {predictors.n_layers}")
    counter = SparsityCounter([0] * n_layers, [0] * n_layers)

    def sparsify(i, x, h):
        loaded = None
        if predictors is not None:
            h, loaded, _ = predictors.read(i, x, h)
        keep = activation_score(h) > thresholds[i]
        if loaded is not None:
            keep &= loaded
        counter.kept[i] += int(keep.sum())
        counter.total[i] += keep.numel()
        return h * keep

    with ffn_hooks(model, sparsify):
        yield counter


@torch.no_grad()
def evaluate(
    model: nn.Module,
    predictors: NeuronPredictor,
    token_ids: torch.Tensor,
    window: int = 512,
    n_windows: int = 4,
    progress: bool = True,
) -> dict:
    """Predictor quality on held-out `token_ids` and end-to-end perplexity.

    Returns {"layers": [{layer, recall, precision, density, true_density, fn_mass}], "ppl_dense",
    "ppl_threshold", "ppl_predictor", "sparsity_threshold", "sparsity"}. Per-layer figures are measured on the
    dense model's activations; `density` is the predicted (loaded) fraction, `fn_mass` the share of the active
    neurons' |score| mass that false negatives lose; `sparsity` the FFN sparsity with predictor and threshold.
    """
    n_tokens = window * n_windows
    ids = token_ids[:n_tokens]
    n_layers = predictors.n_layers
    sums = torch.zeros(n_layers, 5, dtype=torch.float64)  # tp, fp, fn, fn mass, active mass

    def measure(i, x, h):
        s = activation_score(h)
        true = s > predictors.thresholds[i]
        pred = predictors.predict(i, x)
        sums[i] += torch.tensor(
            [
                (true & pred).sum().item(),
                (~true & pred).sum().item(),
                (true & ~pred).sum().item(),
                s[true & ~pred].sum().item(),
                s[true].sum().item(),
            ],
            dtype=torch.float64,
        )

    with ffn_hooks(model, measure):
        run_windows(model, ids, window, progress, "evaluating predictors")
    layers = []
    n_neurons = predictors.n_neurons
    for i, (tp, fp, fn, fn_mass, mass) in enumerate(sums.tolist()):
        layers.append(
            {
                "layer": i,
                "recall": tp / max(tp + fn, 1),
                "precision": tp / max(tp + fp, 1),
                "density": (tp + fp) / (ids.numel() * n_neurons),
                "true_density": (tp + fn) / (ids.numel() * n_neurons),
                "fn_mass": fn_mass / max(mass, 1e-30),
            }
        )
    ppl_dense = perplexity(model, ids, window, n_windows, progress)
    with patched_ffn(model, predictors.thresholds) as threshold_only:
        ppl_threshold = perplexity(model, ids, window, n_windows, progress)
    with patched_ffn(model, predictors.thresholds, predictors) as with_predictor:
        ppl_predictor = perplexity(model, ids, window, n_windows, progress)
    return {
        "layers": layers,
        "ppl_dense": ppl_dense,
        "ppl_threshold": ppl_threshold,
        "ppl_predictor": ppl_predictor,
        "sparsity_threshold": threshold_only.sparsity,
        "sparsity": with_predictor.sparsity,
    }


@torch.no_grad()
def operating_point(
    model: nn.Module,
    predictors: NeuronPredictor,
    token_ids: torch.Tensor,
    true_thresholds: torch.Tensor,
    window: int = 512,
    n_windows: int = 4,
    progress: bool = True,
) -> dict:
    """One pass over held-out `token_ids` with the predictors patched in (as patched_ffn): perplexity, and per
    layer the loaded density, the recall of the true active set (dense score > true_thresholds [L], e.g. the
    oracle's at the same density) and of the output mass (share of the dense sum |h| the loaded neurons carry).

    The loaded density is the fraction of the FFN's weight bytes read: the loaded neurons' share for a neuron
    method (a bundle holds all of a neuron's weights); for an input-sparse method (`NeuronPredictor.read`) the
    input projections' share (rule.input_weight_share) times the fraction of input channels read plus the rest
    times the fraction of W_down rows read. `neuron_density` and `input_density` are those two fractions.

    Returns {"ppl", "density", "neuron_density", "input_density", "recall", "mass_recall" (means over layers),
    "layers": [{layer, density, neuron_density, input_density, recall, mass_recall}]}."""
    n_layers = predictors.n_layers
    if true_thresholds.shape != (n_layers,):
        raise ValueError(f"true_thresholds must have shape ({n_layers},), got {tuple(true_thresholds.shape)}")
    share = input_weight_share(model)
    # loaded, pairs, input channels read, input pairs, true & loaded, true, loaded mass, mass
    sums = torch.zeros(n_layers, 8, dtype=torch.float64)

    def measure(i, x, h):
        s = activation_score(h)
        used, loaded, inputs = predictors.read(i, x, h)
        true = s > true_thresholds[i]
        # Whole neurons: the input projections' bytes read are the loaded neurons' share of them.
        read_in = loaded.float().mean().item() * x.numel() if inputs is None else inputs.sum().item()
        sums[i] += torch.tensor(
            [
                loaded.sum().item(),
                loaded.numel(),
                read_in,
                x.numel(),
                (true & loaded).sum().item(),
                true.sum().item(),
                s[loaded].sum().item(),
                s.sum().item(),
            ],
            dtype=torch.float64,
        )
        return used * (loaded & (activation_score(used) > predictors.thresholds[i]))

    with ffn_hooks(model, measure):
        ppl = perplexity(model, token_ids, window, n_windows, progress)
    layers = []
    for i, (loaded, pairs, read_in, in_pairs, hit, true, loaded_mass, mass) in enumerate(sums.tolist()):
        neuron_density, input_density = loaded / pairs, read_in / in_pairs
        layers.append(
            {
                "layer": i,
                "density": share * input_density + (1.0 - share) * neuron_density,
                "neuron_density": neuron_density,
                "input_density": input_density,
                "recall": hit / max(true, 1),
                "mass_recall": loaded_mass / max(mass, 1e-30),
            }
        )
    keys = ("density", "neuron_density", "input_density", "recall", "mass_recall")
    return {"ppl": ppl, "layers": layers, **{k: sum(layer[k] for layer in layers) / n_layers for k in keys}}
