"""Context-level selection (method "context", in the manner of CoreInfer / TDA): one neuron set per layer for a
block of tokens instead of one per token, so consecutive tokens need the same neurons and the window cache reads
almost nothing between refreshes.

Any other method scores the neurons (`base`). Of a forward of T tokens, the first min(T, prompt) are a prompt,
predicted per token by the base method; their mean scores choose the set for the tokens that follow (the k =
density * n best neurons of the layer); every `block` tokens after that the set is chosen again from the mean
scores of the block just decoded. The state is per layer and carries across calls (decoding one token per
forward); a call of more than one token starts a new sequence (`reset` does too). Teacher-forced evaluation (one
forward of a whole window) therefore sees exactly the sets token-by-token decoding would: the set of a block
depends only on earlier tokens.
"""

from __future__ import annotations

import torch

from flashllm_ext.predictor.base import NeuronPredictor, predictor_class


class ContextPredictor(NeuronPredictor):
    """Block-level sets chosen from a base method's mean scores (see the module doc)."""

    method = "context"

    def __init__(self, base: NeuronPredictor, block: int = 16, prompt: int = 32, density: float = 0.5):
        if block < 1 or prompt < 1:
            raise ValueError(f"block and prompt must be >= 1, got {block}, {prompt}")
        super().__init__(base.n_layers, base.hidden_size, base.n_neurons, base.thresholds)
        self.base, self.block, self.prompt = base, block, prompt
        self.register_buffer("densities", torch.full((base.n_layers,), float(density)))
        self.reset()

    def reset(self) -> None:
        """Forget every layer's set: the next call starts a sequence."""
        self._sets: list[torch.Tensor | None] = [None] * self.n_layers
        self._sums = [torch.zeros(self.n_neurons) for _ in range(self.n_layers)]
        self._counts = [0] * self.n_layers

    def scores(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.base.scores(layer, x)

    def _choose(self, layer: int, mean_scores: torch.Tensor) -> torch.Tensor:
        k = max(1, int(round(float(self.densities[layer]) * self.n_neurons)))
        chosen = torch.zeros(self.n_neurons, dtype=torch.bool)
        chosen[mean_scores.topk(k).indices] = True
        return chosen

    @torch.no_grad()
    def predict(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        scores = self.base.scores(layer, x)
        out = torch.empty(scores.shape, dtype=torch.bool)
        first = 0
        if x.shape[0] > 1 or self._sets[layer] is None:  # a new sequence: its prompt is predicted per token
            first = min(x.shape[0], self.prompt)
            out[:first] = scores[:first] > self.base.cutoffs[layer]
            self._sets[layer] = self._choose(layer, scores[:first].mean(0))
            self._sums[layer].zero_()
            self._counts[layer] = 0
        while first < x.shape[0]:  # decoded tokens, in pieces that end where a block ends
            last = min(x.shape[0], first + self.block - self._counts[layer])
            out[first:last] = self._sets[layer]
            self._sums[layer] += scores[first:last].sum(0)
            self._counts[layer] += last - first
            if self._counts[layer] == self.block:  # refresh from the block just decoded
                self._sets[layer] = self._choose(layer, self._sums[layer] / self.block)
                self._sums[layer].zero_()
                self._counts[layer] = 0
            first = last
        return out

    def set_cutoffs(self, cutoffs: torch.Tensor) -> None:
        super().set_cutoffs(cutoffs)
        self.base.set_cutoffs(cutoffs)

    @torch.no_grad()
    def set_density(self, inputs, density) -> torch.Tensor:
        cutoffs = super().set_density(inputs, density)  # the base's per-token cut-offs for prompts
        self.densities.copy_(torch.as_tensor(density, dtype=torch.float32).expand(self.n_layers))
        return cutoffs

    def config(self) -> dict:
        return {**super().config(), "block": self.block, "prompt": self.prompt, "base": self.base.config()}

    @classmethod
    def from_config(cls, config: dict) -> ContextPredictor:
        base = predictor_class(config["base"]["method"]).from_config(config["base"])
        return cls(base, int(config["block"]), int(config["prompt"]))
