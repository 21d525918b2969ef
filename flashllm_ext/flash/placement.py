"""A placed store's rows seen from the model's neurons: predictors score neurons in the model's order (they are
trained on the checkpoint), while a store converted with a neuron order (flashllm_ext.predictor.placement) holds
neuron order[l][r] in row r of layer l. The engine wraps the predictors once (ffn_stack), so every set, frequency
and read downstream is in rows; the FFN's output is a sum over neurons, the same in any order.
"""

from __future__ import annotations

import torch

from flashllm_ext.flash.store import FlashStore


class StoreOrderPredictors:
    """`predictors` (any object with predict(layer, x) and, optionally, predict_ahead, thresholds, frequency,
    loaded_density) answering in the rows of a store placed by `order` int64 [L, n]. Anything else is the wrapped
    predictors' own."""

    def __init__(self, predictors, order: torch.Tensor):
        self.predictors, self.order = predictors, order.long()
        self.rows = torch.argsort(self.order, dim=1)  # rows[l, neuron]: the row the neuron sits in
        frequency = getattr(predictors, "frequency", None)
        self.frequency = None if frequency is None else frequency.gather(1, self.order.to(frequency.device))
        if hasattr(predictors, "predict_ahead"):
            self.predict_ahead = lambda layer, x: self.to_rows(layer, predictors.predict_ahead(layer, x))

    def __getattr__(self, name: str):
        return getattr(self.__dict__["predictors"], name)

    def predict(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The wrapped predictors' answer for layer `layer` and inputs x [T, d], in rows (to_rows)."""
        return self.to_rows(layer, self.predictors.predict(layer, x))

    def to_rows(self, layer: int, selection: torch.Tensor) -> torch.Tensor:
        """A predictor's answer over neurons (bool [T, n] or [n], or int ids [k]) over rows: the same shape and kind."""
        if selection.dtype == torch.bool:
            return selection[..., self.order[layer].to(selection.device)]
        return self.rows[layer].to(selection.device)[selection.long()]

    @property
    def memory_bytes(self) -> int:
        """The wrapped predictors' memory and the two index maps."""
        return self.predictors.memory_bytes + self.order.nbytes + self.rows.nbytes

    def to(self, device: torch.device | str) -> StoreOrderPredictors:
        """Moves the wrapped predictors (the index maps follow each answer to its device)."""
        self.predictors.to(device)
        return self


def in_store_order(predictors, store: FlashStore):
    """`predictors` as they answer for `store`'s rows: themselves for a store in the model's order, else wrapped."""
    return predictors if store.neuron_order is None else StoreOrderPredictors(predictors, store.neuron_order)
