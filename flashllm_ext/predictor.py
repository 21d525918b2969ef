"""Activation sparsity on real models: capture, per-layer thresholds (SwiGLU) and low-rank neuron predictors.

The one active-neuron rule (shared by calibration, training, `evaluate`, FlashFFN and the sparse_ffn kernel),
per FFN layer with n neurons:
  input   x [T, d]: what the FFN itself receives (after its norm: Llama's post_attention_layernorm, OPT's
          final_layer_norm); the predictor sees exactly this.
  score   |h|: h = act(x . gate + b) * (x . up) for GLU models (SwiGLU), act(x . up + b) otherwise (OPT's
          relu(fc1(x))): what the down projection multiplies, and what sparse_ffn thresholds. (|act(gate)| alone,
          CATS' score, costs far more perplexity at the same sparsity: BENCHMARKS.md.)
  active  score > the layer's threshold (strictly: ties are inactive, as in every kernel). ReLU models have exact
          zeros, so threshold 0 gives their natural sparsity; SwiGLU has none, so the threshold is calibrated to a
          target sparsity.
A predictor guesses the active set from x. The patched FFN used for perplexity computes h = act(gate) * up
densely, then zeroes the inactive neurons: it measures accuracy, not speed.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from .bits import pack_bitmap, unpack_bitmap
from .errors import FormatError
from .models.hf import decoder_layers
from .models.text import perplexity

FORMAT_NAME = "flashllm-predictors"
FORMAT_VERSION = "3"  # 3: predictors see the FFN's normalised input; the score is |h|
TENSOR_PREFIX = "predictor."


# ------------------------------------------------------------------------------------------- model structure

@dataclass
class FFNModules:
    """The modules of one FFN layer the hooks attach to."""
    ffn_input: nn.Module  # its (first) input is x, the FFN's own input
    down: nn.Module  # its input is h


def ffn_modules(model: nn.Module) -> list[FFNModules]:
    """Per-layer FFN modules of a Hugging Face Llama-family or OPT causal LM."""
    layers = decoder_layers(model)
    if layers and hasattr(layers[0], "mlp") and hasattr(layers[0].mlp, "gate_proj"):
        return [FFNModules(layer.mlp, layer.mlp.down_proj) for layer in layers]
    if layers and hasattr(layers[0], "fc2"):
        return [FFNModules(layer.fc1, layer.fc2) for layer in layers]
    raise ValueError(f"{type(model).__name__}: not a Llama-family (mlp.gate_proj) or OPT (fc1/fc2) causal LM")


def activation_score(h: torch.Tensor) -> torch.Tensor:
    """The rule's score [N, n] of the activations h [N, n] the down projection multiplies: |h|."""
    return h.abs()


# Callback of `ffn_hooks`: (layer, x [N, d], h [N, n]) -> replacement h or None.
FFNCallback = Callable[[int, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


@contextmanager
def ffn_hooks(model: nn.Module, callback: FFNCallback) -> Iterator[list[FFNModules]]:
    """Calls `callback` at every FFN layer's down projection during forward passes; a returned tensor replaces
    the down projection's input. Hooks are removed on exit, even on error."""
    modules = ffn_modules(model)
    stash: dict[tuple[str, int], torch.Tensor] = {}
    handles = []

    def keep_x(i: int):
        return lambda module, args: stash.__setitem__(("x", i), args[0])

    def at_down(i: int):
        def hook(module, args):
            h = args[0]
            x = stash.pop(("x", i))
            flat = callback(i, x.reshape(-1, x.shape[-1]), h.reshape(-1, h.shape[-1]))
            return None if flat is None else (flat.view_as(h),)
        return hook

    try:
        for i, m in enumerate(modules):
            handles.append(m.ffn_input.register_forward_pre_hook(keep_x(i)))
            handles.append(m.down.register_forward_pre_hook(at_down(i)))
        yield modules
    finally:
        for handle in handles:
            handle.remove()


@torch.inference_mode()
def _run_windows(model: nn.Module, token_ids: torch.Tensor, window: int, progress: bool, desc: str) -> int:
    """Forward passes over consecutive windows of `window` tokens (the last may be shorter); returns tokens run."""
    if token_ids.dim() != 1 or token_ids.numel() == 0:
        raise ValueError(f"token_ids must be a non-empty 1-D tensor, got shape {tuple(token_ids.shape)}")
    for start in tqdm(range(0, token_ids.numel(), window), desc=desc, disable=not progress, leave=False):
        model(token_ids[start:start + window].unsqueeze(0))
    return token_ids.numel()


# --------------------------------------------------------------------------------------------- thresholds

def calibrate_thresholds(model: nn.Module, token_ids: torch.Tensor, target: float | Sequence[float] = 0.5,
                         window: int = 512, progress: bool = True) -> torch.Tensor | dict[float, torch.Tensor]:
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
        _run_windows(model, token_ids, window, progress, "calibrating thresholds")
    result = {t: torch.zeros(len(scores)) for t in targets}
    for i, chunks in scores.items():
        flat = torch.cat(chunks).flatten().float()
        for t in targets:
            k = int(round(t * flat.numel()))
            result[t][i] = flat.kthvalue(k).values if k > 0 else 0.0
    return result[targets[0]] if isinstance(target, (int, float)) else result


# ----------------------------------------------------------------------------------------------- capture

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


def capture_activations(model: nn.Module, token_ids: torch.Tensor, thresholds: torch.Tensor, window: int = 512,
                        keep_scores: Sequence[int] = (), progress: bool = True) -> ActivationCapture:
    """Record every layer's predictor input and active set (score > threshold) over `token_ids` [T]."""
    n_layers = len(ffn_modules(model))
    if thresholds.shape != (n_layers,):
        raise ValueError(f"thresholds must have shape ({n_layers},) (one per layer), got {tuple(thresholds.shape)}")
    inputs: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
    bitmaps: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
    kept: dict[int, list[torch.Tensor]] = {i: [] for i in keep_scores}
    n_neurons = 0

    def record(i, x, h):
        nonlocal n_neurons
        s = activation_score(h)
        n_neurons = s.shape[1]
        inputs[i].append(x.half())
        bitmaps[i].append(pack_bitmap(s > thresholds[i]))
        if i in kept:
            kept[i].append(s.float())

    with ffn_hooks(model, record):
        _run_windows(model, token_ids, window, progress, "capturing activations")
    return ActivationCapture([torch.cat(c) for c in inputs], [torch.cat(c) for c in bitmaps], n_neurons,
                             thresholds.clone(), {i: torch.cat(c) for i, c in kept.items()})


# -------------------------------------------------------------------------------------------- predictors

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

    def _tensors_and_metadata(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        tensors = {f"{TENSOR_PREFIX}{k}": v.detach().contiguous() for k, v in self.state_dict().items()}
        meta = {"ranks": [p.rank for p in self.predictors], "d": self.predictors[0].down.in_features,
                "n_neurons": self.predictors[0].up.out_features, "top_k": self.top_k}
        return tensors, {"predictors": json.dumps(meta), "predictors_version": FORMAT_VERSION}

    def save(self, path: str | os.PathLike) -> None:
        """Write a standalone predictors file (safetensors)."""
        tensors, meta = self._tensors_and_metadata()
        save_file(tensors, os.fspath(path), metadata={"format": FORMAT_NAME, "version": FORMAT_VERSION, **meta})

    def save_to_store(self, store_dir: str | os.PathLike) -> Path:
        """Add (or replace) the predictors in a flash store's resident file: tensors `predictor.*` and the
        `predictors` metadata entry; everything else in the file is kept. Atomic (temp file + rename)."""
        from .store import RESIDENT_FILE, FlashStore

        store = FlashStore(store_dir)  # validates the store before touching it
        shape = (len(self.predictors), self.predictors[0].down.in_features, self.predictors[0].up.out_features)
        if shape != (store.n_layers, store.hidden_size, store.n_neurons):
            raise ValueError(f"{store_dir}: store has (layers, hidden, neurons) = "
                             f"{(store.n_layers, store.hidden_size, store.n_neurons)}, predictors {shape}")
        path = Path(store_dir) / RESIDENT_FILE
        with safe_open(path, "pt") as f:
            metadata = dict(f.metadata() or {})
            kept = {k: f.get_tensor(k) for k in f.keys() if not k.startswith(TENSOR_PREFIX)}
        tensors, meta = self._tensors_and_metadata()
        partial = path.with_name(path.name + ".partial")
        save_file({**kept, **tensors}, str(partial), metadata={**metadata, **meta})
        os.replace(partial, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> PredictorSet:
        """Read a file written by `save`, or a store directory written by `save_to_store`; FormatError if
        malformed."""
        path = Path(path)
        if path.is_dir():
            from .store import RESIDENT_FILE

            path = path / RESIDENT_FILE
        path = os.fspath(path)
        try:
            with safe_open(path, "pt") as f:
                metadata = f.metadata() or {}
            tensors = load_file(path)
        except (SafetensorError, OSError) as e:
            raise FormatError("header", str(e), path) from e
        standalone = metadata.get("format") == FORMAT_NAME and metadata.get("version") == FORMAT_VERSION
        if not standalone and metadata.get("predictors_version") != FORMAT_VERSION:
            raise FormatError("__metadata__.format", f"expected {FORMAT_NAME} v{FORMAT_VERSION} or a store with "
                              f"predictors, got {metadata.get('format')!r} v{metadata.get('version')!r}", path)
        try:
            meta = json.loads(metadata["predictors"])
            ranks, d, n = [int(r) for r in meta["ranks"]], int(meta["d"]), int(meta["n_neurons"])
            top_k = meta["top_k"]
        except (KeyError, TypeError, ValueError) as e:
            raise FormatError("__metadata__.predictors", f"bad value ({e!r})", path) from None
        predictors = [LowRankPredictor(d, n, r) for r in ranks]
        state = {k.removeprefix(TENSOR_PREFIX): v for k, v in tensors.items() if k.startswith(TENSOR_PREFIX)}
        for key in ("thresholds", "prob_thresholds"):
            if key not in state:
                raise FormatError(f"predictor.{key}", "missing", path)
        out = cls(predictors, state["thresholds"], state["prob_thresholds"], top_k)
        try:
            out.load_state_dict(state)
        except RuntimeError as e:
            raise FormatError("predictor.*", f"tensors disagree with the metadata: {' '.join(str(e).split())}"[:600],
                              path) from None
        return out.eval()


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


# -------------------------------------------------------------------------------------- patched FFN, evaluation

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
        _run_windows(model, ids, window, progress, "evaluating predictors")
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
