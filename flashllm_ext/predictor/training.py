"""Building predictors: `build_predictors` makes any method from calibration text (selected by a target loaded
density); `train_predictors` is the low-rank classifier's training ('LLM in a flash': one LowRankPredictor per
layer fitted to the captured active sets with a class-balanced loss, probability thresholds chosen for a recall on
held-out tokens)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from flashllm_ext.predictor.allocation import allocate_densities
from flashllm_ext.predictor.base import NeuronPredictor, predictor_class
from flashllm_ext.predictor.capture import ActivationCapture, capture_activations
from flashllm_ext.predictor.context import ContextPredictor
from flashllm_ext.predictor.lowrank import LowRankPredictor, PredictorSet, RegressionPredictorSet, fit_log_regression
from flashllm_ext.predictor.oracle import OraclePredictor
from flashllm_ext.predictor.quant import QuantPredictor
from flashllm_ext.predictor.rule import ffn_weights
from flashllm_ext.predictor.teal import TealPredictor
from flashllm_ext.predictor.thresholds import calibrate_thresholds

# The default recipe, the one place that names it (`flashllm train-predictors`, `make demo`, bench_e2e and the
# engine's stores use it). docs/benchmarks/bench_predictor.md: under the 15%-of-the-FFN-bytes
# memory bound, quant with a 3-bit W_gate and a 4-bit W_up (14.7%) whose codes GPTQ rounds against the calibration
# inputs is the measured method with the least loaded density at held-out perplexity <= 1.05x dense: 1.048x at
# density 0.473 (0.466 interpolated, 1.12x the oracle's), where the same format rounded to nearest needed 0.55
# (1.051x there) and quant 4/2 (an earlier default) 0.7. Every loaded neuron is a flash read or a cache row: 0.47
# asks for 15% fewer bundles per token than 0.55. GPTQ changes only the codes' values (same format, same kernel).
DEFAULT_METHOD = "quant"
DEFAULT_DENSITY = 0.45
DEFAULT_GATE_BITS = 3
DEFAULT_UP_BITS = 4
DEFAULT_ROUNDING = "gptq"
DEFAULT_GROUP_SIZE = "auto"  # quant.default_group_size of the model's hidden size
# What a cached store's predictors must have been built with to be the default ones (io.predictors_recipe).
DEFAULT_RECIPE = {
    "method": DEFAULT_METHOD,
    "density": DEFAULT_DENSITY,
    "gate_bits": DEFAULT_GATE_BITS,
    "up_bits": DEFAULT_UP_BITS,
    "rounding": DEFAULT_ROUNDING,
    "group_size": DEFAULT_GROUP_SIZE,
    "statistics": "frequency",
}


def default_rounding(method: str) -> str:
    """How `method` rounds its codes unless told: DEFAULT_ROUNDING for quant, "nearest" (the only choice) for the
    methods that hold no codes of their own."""
    return DEFAULT_ROUNDING if method == "quant" else "nearest"


def predictors_recipe_of(
    method: str,
    density: float | None,
    gate_bits: int = DEFAULT_GATE_BITS,
    up_bits: int = DEFAULT_UP_BITS,
    rounding: str = "nearest",
    allocation: str = "uniform",
    group_size: int | str | None = None,
) -> dict:
    """The recipe saved with a store's predictors (io.save_predictors_to_store): the options build_predictors was
    given. Bits, rounding and group size only for quant; rounding, group size and allocation only where they are not
    the original "nearest" / per row / "uniform", so the recipes of stores built before those options existed still
    read the same. "statistics": what the predictors carry beside their scores (the neurons' calibration frequency,
    which predictors built before it was kept lack)."""
    recipe: dict = {"method": method, "density": density, "statistics": "frequency"}
    if method == "quant":
        recipe |= {"gate_bits": gate_bits, "up_bits": up_bits}
        if rounding != "nearest":
            recipe["rounding"] = rounding
        if group_size is not None:
            recipe["group_size"] = group_size
    if allocation != "uniform":
        recipe["allocation"] = allocation
    return recipe


def auto_rank(density: float, d: int, base_rank: int = 64, base_density: float = 0.3) -> int:
    """Rank for a layer: `base_rank` at `base_density`, growing with the layer's density (denser layers carry
    more information to predict), a multiple of 16 in [16, d // 2]."""
    rank = 16 * math.ceil(base_rank * max(density, 1e-3) / base_density / 16)
    return int(min(max(rank, 16), max(16, d // 2)))


def train_predictor(
    x: torch.Tensor,
    mask: torch.Tensor,
    rank: int,
    epochs: int = 10,
    batch_size: int = 256,
    lr: float = 1e-2,
    false_negative_weight: float | None = None,
    seed: int = 0,
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


def choose_prob_thresholds(
    predictors: Sequence[LowRankPredictor], inputs: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], recall: float
) -> torch.Tensor:
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


def _train_lowrank(
    capture: ActivationCapture,
    rank,
    epochs: int,
    recall: float | None,
    top_k: int | None,
    validation_fraction: float,
    progress: bool,
) -> PredictorSet:
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
    return PredictorSet(predictors, capture.thresholds, probs, top_k)


def build_predictors(
    model: nn.Module,
    token_ids: torch.Tensor,
    method: str = DEFAULT_METHOD,
    *,
    density: float | Sequence[float] | None = DEFAULT_DENSITY,
    target_sparsity: float = 0.6,
    rank: int | Sequence[int] | None = None,
    epochs: int = 10,
    recall: float | None = 0.95,
    gate_bits: int = DEFAULT_GATE_BITS,
    up_bits: int = DEFAULT_UP_BITS,
    rounding: str | None = None,
    group_size: int | str | None = DEFAULT_GROUP_SIZE,
    allocation: str = "uniform",
    base: str = "quant",
    block: int = 16,
    window: int = 512,
    progress: bool = True,
) -> NeuronPredictor:
    """Predictors of `method` (a name of PREDICTOR_METHODS) for `model`, from the calibration `token_ids` [T].

    density: the loaded density (one for all layers or one per layer): each layer's cut-off keeps this fraction
    of the calibration text's (token, neuron) pairs, and the rule's thresholds are 0 (every loaded neuron is
    computed: the density alone sets the I/O); true_thresholds are the oracle's at that density. None (lowrank
    only): the classic operating point, thresholds at `target_sparsity`, probability thresholds for `recall`.
    target_sparsity: the active sets the lowrank classifier learns (and, with density None, the thresholds).
    rank: lowrank / lowrank-reg (None: auto_rank for lowrank, 96 for lowrank-reg). gate_bits, up_bits, rounding
    ("nearest" or "gptq", quant.ROUNDINGS; None: default_rounding(method)), group_size (columns per scale; None:
    one per row; "auto": quant.default_group_size): quant. allocation: how one `density` is spread over the layers
    ("uniform" or "fisher": allocation.ALLOCATIONS, calibrated on the same text; needs one density).
    teal (input sparsity, evaluation only: predictor.teal) keeps the same fraction of input entries and of h.
    base, block: context (the method that scores, and the tokens per set).
    """
    predictor_class(method)  # an unknown name fails before minutes of work
    rounding = default_rounding(method) if rounding is None else rounding
    if density is None and method != "lowrank":
        raise ValueError(f"method {method!r} is selected by a target density: give density=")
    if rounding != "nearest" and method not in ("quant", "context"):
        raise ValueError(f"rounding {rounding!r} is an option of quant (and of context over quant), not {method!r}")
    if group_size not in (None, "auto") and method not in ("quant", "context"):
        raise ValueError(f"group_size is an option of quant (and of context over quant), not {method!r}")
    if allocation != "uniform" and not isinstance(density, (int, float)):
        raise ValueError(f"allocation {allocation!r} spreads one target density over the layers, got {density}")
    thresholds = calibrate_thresholds(model, token_ids, target_sparsity, window, progress)
    capture = capture_activations(model, token_ids, thresholds, window, progress=progress)
    predictors = predictors_from_capture(
        model,
        capture,
        method,
        rank=rank,
        epochs=epochs,
        recall=recall,
        gate_bits=gate_bits,
        up_bits=up_bits,
        rounding=rounding,
        group_size=group_size,
        base=base,
        block=block,
        progress=progress,
    )
    if density is not None:
        if isinstance(density, (int, float)):
            density = allocate_densities(
                model,
                predictors,
                token_ids,
                capture.inputs,
                float(density),
                allocation,
                window=window,
                progress=progress,
            ).tolist()
        select_density(model, predictors, capture.inputs, token_ids, density, window, progress)
    return predictors


def predictors_from_capture(
    model: nn.Module,
    capture: ActivationCapture,
    method: str,
    *,
    rank: int | Sequence[int] | None = None,
    epochs: int = 10,
    recall: float | None = 0.95,
    gate_bits: int = DEFAULT_GATE_BITS,
    up_bits: int = DEFAULT_UP_BITS,
    rounding: str = "nearest",
    group_size: int | str | None = None,
    base: str = "quant",
    block: int = 16,
    progress: bool = True,
) -> NeuronPredictor:
    """Predictors of `method` from a capture of the calibration text (lowrank learns its active sets; the others
    use its inputs or the model's weights), at their own default operating point (see select_density)."""
    n_layers = len(capture.inputs)
    if method == "context":
        if base == "context":
            raise ValueError("a context predictor needs another method as its base")
        return ContextPredictor(
            predictors_from_capture(
                model,
                capture,
                base,
                rank=rank,
                epochs=epochs,
                recall=recall,
                gate_bits=gate_bits,
                up_bits=up_bits,
                rounding=rounding,
                group_size=group_size,
                progress=progress,
            ),
            block,
        )
    if method == "lowrank":
        return _train_lowrank(capture, rank, epochs, recall, None, 0.1, progress)
    if method == "lowrank-reg":
        weights, activation = ffn_weights(model)
        layer_rank = list(rank) if isinstance(rank, Sequence) else [rank or 96] * n_layers
        return RegressionPredictorSet(
            [
                fit_log_regression(x.float(), w.h(x.float(), activation).abs(), r)
                for x, w, r in tqdm(
                    list(zip(capture.inputs, weights, layer_rank)), desc="fitting predictors", disable=not progress
                )
            ],
            torch.zeros(n_layers),
        )
    if method == "quant":
        return QuantPredictor.from_model(
            model,
            gate_bits,
            up_bits,
            rounding=rounding,
            inputs=capture.inputs,
            group_size=group_size,
            progress=progress,
        )
    if method == "oracle":
        return OraclePredictor.from_model(model, capture.thresholds)
    if method == "teal":
        return TealPredictor.from_model(model)
    predictor_class(method)
    raise ValueError(f"method {method!r} cannot be built from a capture")


def select_density(
    model: nn.Module,
    predictors: NeuronPredictor,
    inputs: Sequence[torch.Tensor],
    token_ids: torch.Tensor,
    density: float | Sequence[float],
    window: int = 512,
    progress: bool = True,
) -> None:
    """Put `predictors` at a target loaded density (one, or one per layer) calibrated on the calibration `inputs`
    (per layer [N, d]) and `token_ids` (the text they came from): cut-offs for the density, thresholds 0 (every
    loaded neuron computed), true_thresholds the oracle's at that density."""
    predictors.set_density(inputs, density)
    predictors.thresholds.zero_()
    densities = [
        float(r) for r in ([density] * predictors.n_layers if isinstance(density, (int, float)) else density)
    ]  # as given: the float32 of set_density would shift the quantile
    # One calibration pass serves every distinct density (an allocation may give each layer its own).
    true = calibrate_thresholds(model, token_ids, sorted({1.0 - r for r in densities}), window, progress)
    predictors.true_thresholds.copy_(torch.stack([true[1.0 - r][i] for i, r in enumerate(densities)]))


def train_predictors(
    model: nn.Module,
    token_ids: torch.Tensor,
    target_sparsity: float = 0.7,
    rank: int | Sequence[int] | None = None,
    epochs: int = 10,
    recall: float | None = 0.95,
    top_k: int | None = None,
    window: int = 512,
    validation_fraction: float = 0.1,
    progress: bool = True,
) -> PredictorSet:
    """Calibrate thresholds at `target_sparsity`, capture activations over `token_ids` and train one predictor
    per layer. rank: one for all layers, one per layer, or None (auto_rank from each layer's density).
    recall: pick each layer's probability threshold to reach it on the last `validation_fraction` of the tokens
    (None keeps 0.5)."""
    thresholds = calibrate_thresholds(model, token_ids, target_sparsity, window, progress)
    capture = capture_activations(model, token_ids, thresholds, window, progress=progress)
    return _train_lowrank(capture, rank, epochs, recall, top_k, validation_fraction, progress)
