"""Where each FFN neuron goes on flash: orders of a layer's neurons from calibration statistics, so the rows a token
reads lie in fewer, longer runs (Ripple's co-activation placement; PowerInfer's hot neurons first).

A store converted with an order (flashllm_ext.flash.convert, `flashllm convert --placement`) holds neuron order[r] in
bundle row r; predictors keep scoring neurons in the model's order and the engine maps their sets onto rows
(flashllm_ext.flash.placement). Two placements:

- "frequency": the most frequently active neurons first (NeuronPredictor.frequency). The hot-cold cache pins a
  layer's most frequent neurons, so they become one block of rows the reader never touches, and the cold reads
  coalesce over the rest instead of reading through the pinned rows between them.
- "coactivation": a greedy chain over the co-activation counts: start at the most frequent neuron, then repeatedly
  the unplaced neuron that fired together with the last placed one on most calibration tokens, the most frequent
  where none did (NeuronPredictor.neuron_order, computed with the frequencies).

Both come from the calibration text only (NeuronPredictor.set_density).
"""

from __future__ import annotations

import torch

# int64 [n]: neuron ids by descending frequency (ties in id order): the order a hot set pins in, placed on flash too.
from flashllm_ext.flash.hot_cold import most_frequent_first as frequency_order

PLACEMENTS = ("frequency", "coactivation")


@torch.no_grad()
def coactivation_order(active: torch.Tensor) -> torch.Tensor:
    """int64 [n]: a greedy co-activation chain of the neurons of sets bool [N, n] (N calibration tokens): the most
    frequent neuron first, then each time the unplaced neuron active together with the last one on most tokens
    (the more frequent, then the lowest id, among equals). O(n^2) memory and time: 0.5 GB and seconds for 11008 neurons."""
    if active.dim() != 2 or active.dtype != torch.bool:
        raise ValueError(f"active must be bool [tokens, neurons], got {active.dtype} {tuple(active.shape)}")
    a = active.float()
    # [n, n]: tokens on which both neurons are active, + a fraction of each neuron's own count (< 1, so it only
    # breaks ties: a group's chain ends at a zero count and jumps to the most frequent neuron left)
    together = a.t() @ a + a.sum(dim=0) / (a.shape[0] + 1)
    n = together.shape[0]
    order = torch.empty(n, dtype=torch.long)
    current = int(a.sum(dim=0).argmax()) if n else 0
    for position in range(n):
        order[position] = current
        together[:, current] = -1.0  # placed: never chosen again
        current = int(together[current].argmax())
    return order


def neuron_orders(predictors, placement: str) -> torch.Tensor:
    """int64 [L, n]: each layer's neuron order by `placement` (PLACEMENTS) from the statistics `predictors`
    (a NeuronPredictor) carry; ValueError when they do not carry them (predictors saved before they were kept)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {list(PLACEMENTS)}, got {placement!r}")
    if not predictors.frequency.any():
        raise ValueError(
            "these predictors carry no calibration statistics: build them again (flashllm train-predictors)"
        )
    if placement == "frequency":
        return torch.stack([frequency_order(f) for f in predictors.frequency])
    if not predictors.neuron_order.any():
        raise ValueError(
            "these predictors carry no co-activation order (saved before it was kept): build them again "
            "(flashllm train-predictors)"
        )
    return predictors.neuron_order.long().clone()
