"""Installing FFN modules in a transformers model: where each decoder layer's FFN is (a Llama-family `mlp`, or
OPT's fc1 -> activation -> fc2 applied inline) and putting another module in its place."""

from __future__ import annotations

import os
from collections.abc import Callable

from torch import nn

from flashllm_ext.flash.ffn import FlashFFN
from flashllm_ext.flash.store import FlashStore
from flashllm_ext.hub.hf import decoder_layers


def ffn_slots(model: nn.Module) -> list[tuple[nn.Module, dict[str, nn.Module]]]:
    """Per decoder layer: (the layer, its FFN modules by attribute) of a Llama-family (mlp) or OPT (fc1,
    activation_fn, fc2) model."""
    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: not a Llama-family or OPT causal LM (no decoder layers found)")
    slots = []
    for i, layer in enumerate(layers):
        if hasattr(layer, "mlp"):
            slots.append((layer, {"mlp": layer.mlp}))
        elif hasattr(layer, "fc1") and hasattr(layer, "fc2"):
            slots.append((layer, {"fc1": layer.fc1, "activation_fn": layer.activation_fn, "fc2": layer.fc2}))
        else:
            raise ValueError(f"layer {i} ({type(layer).__name__}) has neither mlp nor fc1/fc2")
    return slots


def set_ffn(layer: nn.Module, ffn: nn.Module) -> None:
    """Make `ffn` the FFN of a decoder layer. OPT applies fc1, its activation and fc2 inline: `ffn` does all three."""
    if hasattr(layer, "mlp"):
        layer.mlp = ffn
    else:
        layer.fc1, layer.activation_fn, layer.fc2 = ffn, nn.Identity(), nn.Identity()


def install_flash_ffn(
    model: nn.Module, store: FlashStore | str | os.PathLike, make: Callable[[FlashStore, int], nn.Module] | None = None
) -> list[nn.Module]:
    """Replace every FFN of a Llama-family (layer.mlp) or OPT (fc1 -> act -> fc2) model by make(store, layer)
    (default: FlashFFN in exact mode). Every cache reads through the store's one reader, shared_reader(store), unless
    `make` passes another. Returns the modules."""
    store = store if isinstance(store, FlashStore) else FlashStore(store)
    make = make or FlashFFN
    slots = ffn_slots(model)
    if len(slots) != store.n_layers:
        raise ValueError(f"{type(model).__name__} has {len(slots)} decoder layers, the store {store.n_layers}")
    modules = []
    for i, (layer, _) in enumerate(slots):
        ffn = make(store, i)
        set_ffn(layer, ffn)
        modules.append(ffn)
    return modules
