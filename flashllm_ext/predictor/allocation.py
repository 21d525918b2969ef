"""Per-layer loaded densities for a target mean, calibrated on calibration text only ("allocation").

"uniform": every layer at the target. "fisher": layers differ in how much the loss suffers when their unloaded
neurons are dropped, so a greedy search moves density to the layers that need it (the kind of allocation TEAL
searches greedily within a block, here across layers):
- cost of layer l at density r: the loss increase when only that layer drops the neurons its predictor does not
  load at r, estimated to second order with the empirical Fisher, as in Kwon et al. 2022 ("A fast post-training
  pruning framework for transformers"): sum over calibration tokens t of (g_t . delta_t)^2, g_t the gradient of the
  next-token loss with respect to the FFN's output and delta_t = W_down (h_t * unloaded_t) the change of that output.
  Per neuron, g_t . W_down[:, i] h_ti is the first-order change of the loss, so one backward pass gives every layer's
  cost at every density (no forward pass per candidate).
- greedy: start with every layer at density 1, and repeatedly lower by `step` the density of the layer whose step
  costs the least, until the mean reaches the target (within step / L).
The costs assume layers add up (each one measured with the others dense); the held-out figures are the check.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from flashllm_ext.predictor.base import NeuronPredictor, keep_cutoff
from flashllm_ext.predictor.rule import ffn_hooks

ALLOCATIONS = ("uniform", "fisher")


def allocate_densities(
    model: nn.Module,
    predictors: NeuronPredictor,
    token_ids: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    density: float,
    allocation: str = "uniform",
    step: float = 0.025,
    min_density: float = 0.05,
    window: int = 512,
    progress: bool = True,
) -> torch.Tensor:
    """float64 [L] per-layer densities with mean `density` (see the module doc) for `predictors`, whose per-layer
    cut-offs will be set from the calibration `inputs` (per layer [N, d], e.g. a capture of `token_ids` [T]) with
    set_density; the Fisher costs come from one forward and backward pass over `token_ids`."""
    if allocation not in ALLOCATIONS:
        raise ValueError(f"allocation must be one of {ALLOCATIONS}, got {allocation!r}")
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    n_layers = predictors.n_layers
    if allocation == "uniform":
        return torch.full((n_layers,), float(density), dtype=torch.float64)
    if not 0.0 < step < 1.0 or not 0.0 < min_density <= density:
        raise ValueError(
            f"need 0 < step < 1 and 0 < min_density <= density, got step {step}, min_density "
            f"{min_density}, density {density}"
        )
    # The densities a layer can take, descending (rounded: 1 - k * step in floating point drifts off the grid).
    grid = [round(1.0 - k * step, 9) for k in range(int((1.0 - min_density) / step + 1e-9) + 1)]
    costs = fisher_costs(model, predictors, token_ids, inputs, grid, window, progress)
    index = [0] * n_layers  # each layer's place in grid
    for _ in range(int(round((1.0 - density) * n_layers / step))):
        extra = [
            costs[i, index[i] + 1] - costs[i, index[i]] if index[i] + 1 < len(grid) else float("inf")
            for i in range(n_layers)
        ]
        cheapest = min(range(n_layers), key=lambda i: (extra[i], i))  # ties: the first layer (deterministic)
        if extra[cheapest] == float("inf"):
            break  # every layer at min_density
        index[cheapest] += 1
    return torch.tensor([grid[i] for i in index], dtype=torch.float64)


def fisher_costs(
    model: nn.Module,
    predictors: NeuronPredictor,
    token_ids: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    grid: Sequence[float],
    window: int = 512,
    progress: bool = True,
) -> torch.Tensor:
    """float64 [L, len(grid)]: per layer, the empirical-Fisher loss increase (module doc) when that layer loads
    only the neurons `predictors` select at each density of `grid` (cut-offs from the calibration `inputs`)."""
    n_layers = predictors.n_layers
    if len(inputs) != n_layers:
        raise ValueError(f"need calibration inputs for {n_layers} layers, got {len(inputs)}")
    if token_ids.dim() != 1 or token_ids.numel() < 2:
        raise ValueError(f"token_ids must be a 1-D tensor of at least 2 tokens, got shape {tuple(token_ids.shape)}")
    # Per layer, the cut-off at each density, ascending (grid is descending): the neurons with a score at or below
    # cut-off j are the ones not loaded at grid[j], exactly as set_density selects them.
    cutoffs = [
        torch.stack([keep_cutoff(predictors.scores(i, x.float()), r) for r in grid])
        for i, x in enumerate(tqdm(inputs, desc="allocation cut-offs", disable=not progress, leave=False))
    ]
    costs = torch.zeros(n_layers, len(grid), dtype=torch.float64)
    stash: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    leaves: dict[int, torch.Tensor] = {}

    def keep(i, x, h):
        stash[i] = (x.detach(), h.detach())

    def add_leaf(i: int):
        # A zero added to the FFN's output: its gradient is the gradient with respect to that output.
        def hook(module, args, out):
            leaves[i] = torch.zeros_like(out, requires_grad=True)
            return out + leaves[i]

        return hook

    requires = [p.requires_grad for p in model.parameters()]
    with ffn_hooks(model, keep) as modules, torch.enable_grad():
        handles = [m.down.register_forward_hook(add_leaf(i)) for i, m in enumerate(modules)]
        try:
            for p in model.parameters():
                p.requires_grad_(False)
            for start in tqdm(
                range(0, token_ids.numel(), window), desc="allocation (Fisher)", disable=not progress, leave=False
            ):
                ids = token_ids[start : start + window]  # next-token loss within the window, as perplexity() scores
                logits = model(ids.unsqueeze(0)).logits[0]
                F.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum").backward()
                for i, m in enumerate(modules):
                    x, h = stash.pop(i)
                    leaf = leaves.pop(i)
                    g = leaf.grad.reshape(-1, leaf.shape[-1])
                    # Per (token, neuron): the first-order loss change of dropping the neuron.
                    contribution = (g.float() @ m.down.weight.float()) * h.float()
                    scores = predictors.scores(i, x.float())
                    # Bucket j+1.. = the densities at which the neuron is not loaded (score <= cutoffs[j]).
                    bucket = torch.bucketize(scores, cutoffs[i], right=False)
                    per_density = torch.zeros(contribution.shape[0], len(grid) + 1, dtype=torch.float64)
                    per_density.scatter_add_(1, bucket, contribution.double())
                    costs[i] += per_density[:, :-1].cumsum(1).pow(2).sum(0)
        finally:
            for handle in handles:
                handle.remove()
            for p, r in zip(model.parameters(), requires):
                p.requires_grad_(r)
    return costs
