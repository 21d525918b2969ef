"""The neuron predictor interface every method implements, the registry of methods by name, and selection by a
target loaded density.

A predictor set holds, per FFN layer, what it needs to score neurons from the FFN's input x (the rule's input,
flashllm_ext.predictor.rule): `scores(layer, x)` float32 [T, n], higher = more likely active; `predict(layer, x)`
bool [T, n] = scores > the layer's cut-off. Selecting by a target loaded density sets each layer's cut-off to the
score quantile that keeps that fraction of (token, neuron) pairs on calibration inputs (`set_density`).

`thresholds` [L] are the rule's per-layer thresholds the kernel applies to the loaded neurons (0: every loaded
neuron is computed). `true_thresholds` [L] (0 if unknown) are the rule's thresholds whose true active sets have the
predictors' loaded density on the calibration text: the oracle at the same density, against which recall is
measured. `frequency` [L, n] is the fraction of the calibration tokens whose predicted set holds each neuron (set with
the density; zeros: unknown), the statistics the engine's hot-cold cache pins its hot neurons by; `neuron_order`
[L, n] a co-activation order of each layer's neurons on those sets (predictor.placement; zeros: unknown), by which a
store can place them on flash. A method registers
itself by subclassing with `method = "<name>"`; `save`/`load` in `predictor.io` store `config()` (JSON) next to the
tensors of `state_dict()` and rebuild with `from_config`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn

from flashllm_ext.predictor.placement import coactivation_order

PREDICTOR_METHODS: dict[str, type[NeuronPredictor]] = {}


class NeuronPredictor(nn.Module):
    """Per-layer neuron predictors of one model (L layers, hidden size d, n neurons per layer); see the module doc.

    Subclasses define `method`, `scores`, `config` (adding their own keys to the base's) and `from_config`.
    """

    method: ClassVar[str] = ""
    # The store layout its reads need: "bundles" (whole neurons, what convert.py writes and the engine serves), or
    # "input-channels" (W_gate / W_up columns by input channel: no such store exists, evaluation only).
    store_layout: ClassVar[str] = "bundles"
    # The mean loaded density the cut-offs were calibrated for (set_density; kept in the config), None if unknown:
    # the engine's cache_layout="auto" compares a layer's cache with the set it will have to hold.
    loaded_density: float | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.method:
            PREDICTOR_METHODS[cls.method] = cls

    def __init__(
        self,
        n_layers: int,
        hidden_size: int,
        n_neurons: int,
        thresholds: torch.Tensor | None = None,
        cutoffs: torch.Tensor | None = None,
    ):
        super().__init__()
        self.n_layers, self.hidden_size, self.n_neurons = n_layers, hidden_size, n_neurons
        self.register_buffer("thresholds", _per_layer(thresholds, n_layers, "thresholds", 0.0))
        self.register_buffer("cutoffs", _per_layer(cutoffs, n_layers, "cutoffs", 0.0))
        self.register_buffer("true_thresholds", torch.zeros(n_layers))
        self.register_buffer("frequency", torch.zeros(n_layers, n_neurons))
        # int32: half of int64's memory, which a served predictor is charged for (it is only read at conversion)
        self.register_buffer("neuron_order", torch.zeros(n_layers, n_neurons, dtype=torch.int32))

    def scores(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """float32 [T, n]: how likely each neuron is active for each input x [T, d] (higher: more)."""
        raise NotImplementedError

    @torch.no_grad()
    def predict(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """bool [T, n]: neurons predicted active (to load) for inputs x [T, d]."""
        return self.scores(layer, x) > self.cutoffs[layer]

    @torch.no_grad()
    def read(
        self, layer: int, x: torch.Tensor, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What the FFN computes from this method's reads, for inputs x [T, d] whose dense activations are h [T, n]:
        (the activations it computes [T, n], bool [T, n] the neurons whose W_down rows are read, bool [T, d] the
        input channels whose W_gate / W_up columns are read, or None: those of every loaded neuron). A neuron
        method reads whole neurons (bundles), so its activations are h itself."""
        return h, self.predict(layer, x), None

    def reset(self) -> None:
        """Forget any per-sequence state before a new sequence (stateless methods have none)."""

    def set_cutoffs(self, cutoffs: torch.Tensor) -> None:
        """Per-layer cut-offs [L] in score units: a neuron is predicted active when its score is above."""
        self.cutoffs.copy_(_per_layer(cutoffs, self.n_layers, "cutoffs", 0.0))

    @torch.no_grad()
    def set_density(self, inputs: Sequence[torch.Tensor], density: float | Sequence[float]) -> torch.Tensor:
        """Cut-offs so that a fraction `density` (one for all layers, or one per layer) of the (token, neuron)
        pairs of the calibration inputs (per layer [N, d]) is predicted active, and each neuron's frequency in
        those sets and their co-activation order. Returns the cut-offs [L]."""
        densities = self.layer_densities(inputs, density)
        cutoffs = torch.zeros(self.n_layers)
        for i, x in enumerate(inputs):
            scores = self.scores(i, x.float())
            cutoffs[i] = keep_cutoff(scores, float(densities[i]))
            active = scores > cutoffs[i]
            self.frequency[i] = active.float().mean(dim=0)
            self.neuron_order[i] = coactivation_order(active)
        self.set_cutoffs(cutoffs)
        self.loaded_density = float(densities.mean())
        return cutoffs

    def layer_densities(self, inputs: Sequence[torch.Tensor], density: float | Sequence[float]) -> torch.Tensor:
        """fp32 [L]: `density` (one for all layers, or one per layer), checked, for calibration inputs (per layer)."""
        if len(inputs) != self.n_layers:
            raise ValueError(f"need calibration inputs for {self.n_layers} layers, got {len(inputs)}")
        densities = _per_layer(
            None if isinstance(density, (int, float)) else torch.tensor(density),
            self.n_layers,
            "density",
            float(density) if isinstance(density, (int, float)) else 0.0,
        )
        if not ((densities > 0) & (densities <= 1)).all():
            raise ValueError(f"densities must be in (0, 1], got {densities.tolist()}")
        return densities

    def config(self) -> dict:
        """JSON-serialisable description from which `from_config` rebuilds an empty set of the same shapes."""
        return {
            "method": self.method,
            "n_layers": self.n_layers,
            "hidden_size": self.hidden_size,
            "n_neurons": self.n_neurons,
            "loaded_density": self.loaded_density,
        }

    @classmethod
    def from_config(cls, config: dict) -> NeuronPredictor:
        """An instance with the shapes `config` describes (values to be loaded with load_state_dict)."""
        raise NotImplementedError

    @property
    def memory_bytes(self) -> int:
        """DRAM the predictors hold: every parameter and buffer."""
        return sum(t.numel() * t.element_size() for t in list(self.parameters()) + list(self.buffers()))

    def check_shape(self, n_layers: int, hidden_size: int, n_neurons: int, where: str) -> None:
        """ValueError unless these predictors are for a model of (n_layers, hidden_size, n_neurons)."""
        mine = (self.n_layers, self.hidden_size, self.n_neurons)
        if mine != (n_layers, hidden_size, n_neurons):
            raise ValueError(
                f"{where} has (layers, hidden, neurons) = {(n_layers, hidden_size, n_neurons)}, the "
                f"{self.method} predictors {mine}"
            )


def keep_cutoff(values: torch.Tensor, density: float) -> torch.Tensor:
    """The scalar above which a fraction `density` of `values` lies (all of them for density 1)."""
    flat = values.flatten()
    k = int(round((1.0 - density) * flat.numel()))  # values at or below the cut-off
    return flat.kthvalue(k).values if k > 0 else torch.nextafter(flat.min(), torch.tensor(-1e30))


def _per_layer(values: torch.Tensor | None, n_layers: int, name: str, fill: float) -> torch.Tensor:
    if values is None:
        return torch.full((n_layers,), fill)
    values = torch.as_tensor(values).float()
    if values.shape != (n_layers,):
        raise ValueError(f"{name} must have one value per layer ({n_layers},), got {tuple(values.shape)}")
    return values.clone()


def predictor_class(method: str) -> type[NeuronPredictor]:
    """The class registered under `method`; ValueError naming the known ones."""
    if method not in PREDICTOR_METHODS:
        raise ValueError(f"unknown predictor method {method!r}: one of {sorted(PREDICTOR_METHODS)}")
    return PREDICTOR_METHODS[method]
