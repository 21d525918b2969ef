"""Training predictors: one LowRankPredictor per layer fitted to the captured active sets with a class-balanced
loss, probability thresholds chosen for a recall on held-out tokens."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from .capture import capture_activations
from .lowrank import LowRankPredictor, PredictorSet
from .thresholds import calibrate_thresholds


def auto_rank(density: float, d: int, base_rank: int = 64, base_density: float = 0.3) -> int:
    """Rank for a layer: `base_rank` at `base_density`, growing with the layer's density (denser layers carry
    more information to predict), a multiple of 16 in [16, d // 2]."""
    rank = 16 * math.ceil(base_rank * max(density, 1e-3) / base_density / 16)
    return int(min(max(rank, 16), max(16, d // 2)))


def train_predictor(x: torch.Tensor, mask: torch.Tensor, rank: int, epochs: int = 10, batch_size: int = 256,
                    lr: float = 1e-2, false_negative_weight: float | None = None, seed: int = 0
                    ) -> LowRankPredictor:
    """Fit a LowRankPredictor to x [N, d] -> mask bool [N, n] with a class-balanced BCE.

    Positives (active neurons) weigh n_inactive / n_active unless `false_negative_weight` is given: a missed
    active neuron costs as much in total as all the inactive ones, as in 'LLM in a flash'.
    """
    if x.dim() != 2 or mask.dim() != 2 or x.shape[0] != mask.shape[0]:
        raise ValueError(f"need x [N, d] and mask [N, n] with the same N, got {tuple(x.shape)}, {tuple(mask.shape)}")
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        predictor = LowRankPredictor(x.shape[1], mask.shape[1], rank)
    n_active = mask.sum().item()
    pos_weight = false_negative_weight or (mask.numel() - n_active) / max(n_active, 1)
    loss_fn = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(float(pos_weight)))
    optimizer = torch.optim.Adam(predictor.parameters(), lr=lr)
    targets = mask.float()
    with torch.enable_grad():
        for _ in range(epochs):
            for batch in torch.randperm(x.shape[0], generator=generator).split(batch_size):
                optimizer.zero_grad(set_to_none=True)
                loss_fn(predictor(x[batch]), targets[batch]).backward()
                optimizer.step()
    return predictor.eval()


def choose_prob_thresholds(predictors: Sequence[LowRankPredictor], inputs: Sequence[torch.Tensor],
                           masks: Sequence[torch.Tensor], recall: float) -> torch.Tensor:
    """Per layer, the largest probability threshold that keeps recall >= `recall` on (inputs, masks)."""
    out = torch.zeros(len(predictors))
    with torch.no_grad():
        for i, (predictor, x, mask) in enumerate(zip(predictors, inputs, masks)):
            active_probs = torch.sigmoid(predictor(x))[mask]
            if active_probs.numel():
                # Missing at most a (1 - recall) fraction of the active neurons: cut below that quantile.
                k = int(math.floor((1.0 - recall) * active_probs.numel()))
                cut = active_probs.kthvalue(k).values if k > 0 else active_probs.min()
                out[i] = torch.nextafter(cut, torch.tensor(-1.0))  # strictly below: ">" keeps the cut-off neuron
    return out


def train_predictors(model: nn.Module, token_ids: torch.Tensor, target_sparsity: float = 0.7,
                     rank: int | Sequence[int] | None = None, epochs: int = 10,
                     recall: float | None = 0.95, top_k: int | None = None, window: int = 512,
                     validation_fraction: float = 0.1, progress: bool = True) -> PredictorSet:
    """Calibrate thresholds at `target_sparsity`, capture activations over `token_ids` and train one predictor
    per layer. rank: one for all layers, one per layer, or None (auto_rank from each layer's density).
    recall: pick each layer's probability threshold to reach it on the last `validation_fraction` of the tokens
    (None keeps 0.5)."""
    thresholds = calibrate_thresholds(model, token_ids, target_sparsity, window, progress)
    capture = capture_activations(model, token_ids, thresholds, window, progress=progress)
    n_layers = len(capture.inputs)
    if isinstance(rank, Sequence) and len(rank) != n_layers:
        raise ValueError(f"need one rank per layer ({n_layers}), got {len(rank)}")
    n_train = int(round(capture.inputs[0].shape[0] * (1.0 - validation_fraction)))
    predictors, val_inputs, val_masks = [], [], []
    for i in tqdm(range(n_layers), desc="training predictors", disable=not progress):
        x, mask = capture.inputs[i].float(), capture.mask(i)
        d = x.shape[1]
        layer_rank = rank[i] if isinstance(rank, Sequence) else rank or auto_rank(mask.float().mean().item(), d)
        predictors.append(train_predictor(x[:n_train], mask[:n_train], layer_rank, epochs=epochs, seed=i))
        val_inputs.append(x[n_train:])
        val_masks.append(mask[n_train:])
    probs = None if recall is None else choose_prob_thresholds(predictors, val_inputs, val_masks, recall)
    return PredictorSet(predictors, thresholds, probs, top_k)
