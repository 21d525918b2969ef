"""Input sparsity in the manner of TEAL / R-Sparse (method "teal"): no predictor weights, only per-layer magnitude
thresholds on the FFN's input x and on its intermediate activations h.

Per layer and token: the entries of x with |x_j| <= the layer's input threshold are zeroed, so only the kept input
channels' columns of W_gate and W_up are read; h = act(x_kept . gate + b) * (x_kept . up + b) is computed from those
columns, and only the neurons with |h| > the layer's cut-off are kept, so only their rows of W_down are read (TEAL
sparsifies the down projection's input by magnitude in the same way). The loaded density is the fraction of the
FFN's weight bytes read: (2 * input density + neuron density) / 3 for a GLU (W_gate and W_up columns, W_down
rows), (input + neuron density) / 2 otherwise. `set_density(D)` keeps a fraction D of the calibration text's input
entries and then of the (token, neuron) pairs of h computed from the sparsified inputs (TEAL's uniform allocation),
so the loaded density is D.

Reading W_gate / W_up by input channel needs a second store layout (columns of the input projections contiguous per
input channel, next to the neuron bundles of `convert.py`): this library does not write one, so the engine refuses
these predictors and they are measured only through `predictor.evaluation` (bench/bench_predictor.py), against the
neuron methods at the same loaded density. Computing h needs the model's input projections: `from_model` and
`attach` hold references to float32 copies of them, which are the FFN's own weights (read from the store at run
time), not predictor memory; a loaded predictor keeps only its thresholds and must be attached before use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn

from flashllm_ext.predictor.base import NeuronPredictor, keep_cutoff
from flashllm_ext.predictor.rule import FFNWeights, ffn_weights


class TealPredictor(NeuronPredictor):
    """Magnitude thresholds on the FFN input (`input_thresholds` [L]) and on h (`cutoffs` [L]); see the module doc."""

    method = "teal"
    store_layout: ClassVar[str] = "input-channels"

    def __init__(self, n_layers: int, hidden_size: int, n_neurons: int, activation: str, glu: bool):
        super().__init__(n_layers, hidden_size, n_neurons)
        self.activation, self.glu = activation, glu
        self.register_buffer("input_thresholds", torch.zeros(n_layers))
        self._weights: list[FFNWeights] | None = None

    @classmethod
    def from_model(cls, model: nn.Module) -> TealPredictor:
        """Input sparsity for a Llama-family or OPT model, every input entry and neuron kept until set_density."""
        weights, activation = ffn_weights(model)
        first = weights[0]
        out = cls(len(weights), first.up.shape[1], first.up.shape[0], activation, first.gate is not None)
        out._weights = weights
        return out.eval()

    def attach(self, model: nn.Module) -> TealPredictor:
        """Use `model`'s input projections to compute h (a loaded predictor holds only its thresholds)."""
        weights, activation = ffn_weights(model)
        first = weights[0]
        self.check_shape(len(weights), first.up.shape[1], first.up.shape[0], "the model")
        if (activation, first.gate is not None) != (self.activation, self.glu):
            raise ValueError(
                f"the model's FFN is ({activation}, glu={first.gate is not None}), the teal predictors' "
                f"({self.activation}, glu={self.glu})"
            )
        self._weights = weights
        return self

    def input_mask(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """bool [T, d]: the input entries kept (|x| above the layer's input threshold)."""
        return x.abs() > self.input_thresholds[layer]

    def _sparse_h(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._weights is None:
            raise ValueError(
                "teal predictors compute h from the model's input projections: build them with "
                "TealPredictor.from_model(model) or call .attach(model) after loading"
            )
        keep = self.input_mask(layer, x)
        return self._weights[layer].h(x.float() * keep, self.activation), keep

    @torch.no_grad()
    def scores(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """|h| [T, n] computed from the sparsified input."""
        return self._sparse_h(layer, x)[0].abs()

    @torch.no_grad()
    def read(
        self, layer: int, x: torch.Tensor, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        used, keep = self._sparse_h(layer, x)
        loaded = used.abs() > self.cutoffs[layer]
        return used, loaded, keep

    @torch.no_grad()
    def set_density(self, inputs: Sequence[torch.Tensor], density: float | Sequence[float]) -> torch.Tensor:
        """Input thresholds keeping a fraction `density` of each layer's calibration input entries, then cut-offs
        on h (from the sparsified inputs) keeping that fraction of the (token, neuron) pairs. Returns the cut-offs."""
        densities = self.layer_densities(inputs, density)
        for i, x in enumerate(inputs):
            self.input_thresholds[i] = keep_cutoff(x.float().abs(), float(densities[i]))
        return super().set_density(inputs, densities.tolist())

    def config(self) -> dict:
        return {**super().config(), "activation": self.activation, "glu": self.glu}

    @classmethod
    def from_config(cls, config: dict) -> TealPredictor:
        return cls(
            int(config["n_layers"]),
            int(config["hidden_size"]),
            int(config["n_neurons"]),
            str(config["activation"]),
            bool(config["glu"]),
        )
