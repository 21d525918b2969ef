"""The oracle (method "oracle"): the true scores |h| from full float32 copies of every layer's input projections,
so its active set at the rule's thresholds is the true one. The frontier other methods are measured against; its
memory (two thirds of the FFN weights in float32) makes it no deployable predictor."""

from __future__ import annotations

import torch
from torch import nn

from flashllm_ext.predictor.base import NeuronPredictor
from flashllm_ext.predictor.rule import FFNWeights, ffn_weights


class _Projections(nn.Module):
    """One layer's FFNWeights held as buffers (so they save, load and count as the predictor's memory)."""

    def __init__(self, d: int, n: int, glu: bool, gate_bias: bool, up_bias: bool):
        super().__init__()
        self.register_buffer("up", torch.zeros(n, d))
        self.register_buffer("up_bias", torch.zeros(n) if up_bias else None)
        self.register_buffer("gate", torch.zeros(n, d) if glu else None)
        self.register_buffer("gate_bias", torch.zeros(n) if glu and gate_bias else None)

    def weights(self) -> FFNWeights:
        return FFNWeights(self.gate, self.gate_bias, self.up, self.up_bias)


class OraclePredictor(NeuronPredictor):
    """scores = |h| exactly as the model computes it; cut-offs start at the rule's thresholds (the true set)."""

    method = "oracle"

    def __init__(
        self,
        n_layers: int,
        hidden_size: int,
        n_neurons: int,
        activation: str,
        glu: bool,
        gate_bias: bool = False,
        up_bias: bool = False,
        thresholds: torch.Tensor | None = None,
    ):
        super().__init__(n_layers, hidden_size, n_neurons, thresholds, thresholds)
        self.activation, self.glu, self.gate_bias, self.up_bias = activation, glu, gate_bias, up_bias
        self.layers = nn.ModuleList(
            _Projections(hidden_size, n_neurons, glu, gate_bias, up_bias) for _ in range(n_layers)
        )

    @classmethod
    def from_model(cls, model: nn.Module, thresholds: torch.Tensor) -> OraclePredictor:
        """The oracle of a Llama-family or OPT model at the rule's per-layer `thresholds` [L]."""
        weights, activation = ffn_weights(model)
        first = weights[0]
        out = cls(
            len(weights),
            first.up.shape[1],
            first.up.shape[0],
            activation,
            first.gate is not None,
            first.gate_bias is not None,
            first.up_bias is not None,
            thresholds,
        )
        for layer, w in zip(out.layers, weights):
            for name in ("up", "up_bias", "gate", "gate_bias"):
                if getattr(w, name) is not None:
                    getattr(layer, name).copy_(getattr(w, name))
        return out.eval()

    @torch.no_grad()
    def scores(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.layers[layer].weights().h(x, self.activation).abs()

    def config(self) -> dict:
        return {
            **super().config(),
            "activation": self.activation,
            "glu": self.glu,
            "gate_bias": self.gate_bias,
            "up_bias": self.up_bias,
        }

    @classmethod
    def from_config(cls, config: dict) -> OraclePredictor:
        return cls(
            int(config["n_layers"]),
            int(config["hidden_size"]),
            int(config["n_neurons"]),
            str(config["activation"]),
            bool(config["glu"]),
            bool(config["gate_bias"]),
            bool(config["up_bias"]),
        )
