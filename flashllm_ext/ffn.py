"""FlashFFN: an nn.Module that takes the place of a model's MLP and computes it from a flash store.

Per step (a group of `tokens_per_step` tokens): active neuron ids (a predictor, a fixed set, or every neuron) ->
NeuronCache.step (evict, read the missing bundles) -> torch.ops.flashllm.sparse_ffn over the cached rows (+ the
output projection's bias). Exact mode (every neuron active, threshold 0, capacity >= n_neurons) reproduces the
dense MLP of the same weights up to float rounding.

`install_flash_ffn(model, store)` swaps every FFN of a Hugging Face Llama-family or OPT model for FlashFFN.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable

import torch
from torch import nn

from .cache import NeuronCache, StepStats
from .models.hf import decoder_layers
from .reader import FlashReader
from .store import FlashStore

# Model config activation names -> sparse_ffn activations. Only exact matches: tanh-approximated GELU variants would
# silently differ from the model.
_ACTIVATIONS = {"relu": "relu", "silu": "silu", "swish": "silu", "gelu": "gelu"}

# What a predictor may return: int64 ids [k], or a bool mask [n] or [T, n] (a neuron is active if any token needs it).
Predictor = Callable[[torch.Tensor], torch.Tensor]


def store_activation(store: FlashStore) -> str:
    """The sparse_ffn activation of the store's model (config hidden_act / activation_function)."""
    name = store.config.get("hidden_act") or store.config.get("activation_function")
    if name is None:
        raise ValueError(f"{store.path}: the model config names no activation (hidden_act / activation_function)")
    if name not in _ACTIVATIONS:
        raise ValueError(f"{store.path}: activation {name!r} is not supported (one of {sorted(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


def _output_bias(store: FlashStore, layer: int) -> torch.Tensor | None:
    from safetensors import safe_open

    pattern = re.compile(rf"^(?:.*\.)?layers\.{layer}\.(?:mlp\.)?(fc2|down_proj)\.bias$")
    with safe_open(store.resident_path, framework="pt") as f:
        name = next((n for n in f.keys() if pattern.match(n)), None)
        return None if name is None else f.get_tensor(name).float()


def active_ids_of(selection: torch.Tensor, n_neurons: int) -> torch.Tensor:
    """int64 ids from a predictor's answer: ids [k] as they are, a bool mask [n] or [T, n] as its active ids."""
    if selection.dtype == torch.bool:
        if selection.shape[-1] != n_neurons or selection.dim() not in (1, 2):
            raise ValueError(f"a bool mask must have shape [n] or [T, n] with n={n_neurons}, got "
                             f"{tuple(selection.shape)}")
        mask = selection if selection.dim() == 1 else selection.any(dim=0)
        return mask.nonzero().flatten()
    if selection.dim() != 1 or selection.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"active ids must be a 1-D integer tensor, got {selection.dtype} of shape "
                         f"{tuple(selection.shape)}")
    return selection.to(torch.int64)


class FlashFFN(nn.Module):
    """One FFN layer served from a flash store through a NeuronCache.

    predictor: callable x [T, d] -> ids or bool mask (see Predictor); active_ids: a fixed set used for every
    step; neither: every neuron (exact mode). threshold: sparse_ffn's activation threshold (0: none).
    capacity / budget_bytes / window / reader: NeuronCache's. tokens_per_step: tokens sharing one cache step.
    Input x [..., d] of any float dtype; computed in the store's dtype with float32 accumulation.
    """

    def __init__(self, store: FlashStore | str | os.PathLike, layer: int, *, predictor: Predictor | None = None,
                 active_ids: torch.Tensor | None = None, threshold: float = 0.0, capacity: int | None = None,
                 budget_bytes: int | None = None, window: int = 5, tokens_per_step: int = 1,
                 reader: FlashReader | None = None):
        super().__init__()
        self.store = store if isinstance(store, FlashStore) else FlashStore(store)
        if predictor is not None and active_ids is not None:
            raise ValueError("give a predictor or a fixed active_ids set, not both")
        if tokens_per_step < 1:
            raise ValueError(f"tokens_per_step must be >= 1, got {tokens_per_step}")
        if capacity is None and budget_bytes is None:
            capacity = self.store.n_neurons
        self.cache = NeuronCache(self.store, layer, capacity, window, budget_bytes=budget_bytes, reader=reader)
        self.layer, self.predictor, self.threshold = layer, predictor, float(threshold)
        self.tokens_per_step = tokens_per_step
        self.activation = store_activation(self.store)
        n = self.store.n_neurons
        fixed = torch.arange(n) if active_ids is None else active_ids_of(active_ids, n)
        self.fixed_ids = None if predictor is not None else self.store.check_ids(fixed)
        self.register_buffer("out_bias", _output_bias(self.store, layer), persistent=False)
        self.last_stats: list[StepStats] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.store.hidden_size
        if x.shape[-1] != d:
            raise ValueError(f"x must end in the hidden size {d}, got shape {tuple(x.shape)}")
        flat = x.reshape(-1, d)
        out = torch.empty(flat.shape, dtype=torch.float32)
        self.last_stats = []
        for start in range(0, flat.shape[0], self.tokens_per_step):
            chunk = flat[start:start + self.tokens_per_step]
            ids = self.fixed_ids if self.predictor is None else active_ids_of(self.predictor(chunk),
                                                                               self.store.n_neurons)
            self.last_stats.append(self.cache.step(ids))
            cache = self.cache
            y = torch.ops.flashllm.sparse_ffn(chunk.to(self.store.dtype).contiguous(), cache.matrix, cache.num_used,
                                              cache.bias, self.activation, self.store.glu, None, self.threshold)
            out[start:start + chunk.shape[0]] = y.float()
        if self.out_bias is not None:
            out += self.out_bias
        return out.to(x.dtype).reshape(x.shape)


def install_flash_ffn(model: nn.Module, store: FlashStore | str | os.PathLike,
                      make: Callable[[FlashStore, int], FlashFFN] | None = None) -> list[FlashFFN]:
    """Replace every FFN of a Llama-family (layer.mlp) or OPT (fc1 -> act -> fc2) model by a FlashFFN over
    `store`; make(store, layer) builds each (default: exact mode). Every cache reads through the store's one
    reader, store.reader(), unless `make` passes another. Returns the modules."""
    store = store if isinstance(store, FlashStore) else FlashStore(store)
    make = make or FlashFFN
    layers = decoder_layers(model)
    if layers is None or len(layers) != store.n_layers:
        raise ValueError(f"{type(model).__name__}: expected {store.n_layers} decoder layers matching the store")
    modules = []
    for i, layer in enumerate(layers):
        ffn = make(store, i)
        if hasattr(layer, "mlp"):
            layer.mlp = ffn
        elif hasattr(layer, "fc1") and hasattr(layer, "fc2"):
            # OPT applies fc1, its activation and fc2 inline: FlashFFN does all three.
            layer.fc1, layer.activation_fn, layer.fc2 = ffn, nn.Identity(), nn.Identity()
        else:
            raise ValueError(f"layer {i} ({type(layer).__name__}) has neither mlp nor fc1/fc2")
        modules.append(ffn)
    return modules
