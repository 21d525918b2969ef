"""The lean decoder over an offload layer store (flashllm_ext.offload): whole decoder layers in memory or read from
SSD for every token by a DRAM budget, computed by the family models of flashllm_ext.decoder, no transformers.

    decoder = load_offload_decoder(store_dir, dram_budget="30%")    # dense, Endor or quantized store
    decoder.forward(prompt_ids); decoder.stats(); decoder.close()

The placement, the slots, the background fetch of the next SSD layer and the stats are the OffloadRuntime's, as for
the transformers model load_offload builds. The family models are built with an OffloadedWeight in place of each
decoder-layer matrix; the layers the budget keeps in memory get their weights once, fused as the decoder multiplies
them (q, k and v one matrix; the GLU's gate and up one), and an SSD layer's weights are put in place before each of
its forwards: views over the slot it was read into, fused without a copy where the store holds the parts back to
back (a layer's tensors are written in order, 64 bytes apart), the views of each slot made once. Endor matrices
multiply themselves through the runtime (endor_linear for decode, block-wise decompression for prompts).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from flashllm_ext import endor
from flashllm_ext.decoder.config import DecoderConfig
from flashllm_ext.decoder.kv_cache import StaticKVCache
from flashllm_ext.decoder.layers import (
    DenseFFN,
    OffloadedWeight,
    ResidentWeights,
    Weight,
    cat_rows,
)
from flashllm_ext.decoder.model import FAMILY_MODELS, FamilyModel, LeanDecoder, model_table_bytes
from flashllm_ext.offload.api import offload_runtime, open_layer_store
from flashllm_ext.offload.runtime import OffloadRuntime
from flashllm_ext.offload.store import LayerStore
from flashllm_ext.ops import config_activation
from flashllm_ext.ops.blocks import QuantizedWeight
from flashllm_ext.runtime import tensor_bytes

# Each family's FFN matrices in a decoder layer: gate (None: no GLU), up, down
FFN_MATRICES = {
    "llama": ("layers.{}.mlp.gate_proj", "layers.{}.mlp.up_proj", "layers.{}.mlp.down_proj"),
    "gemma": ("layers.{}.mlp.gate_proj", "layers.{}.mlp.up_proj", "layers.{}.mlp.down_proj"),
    "opt": (None, "decoder.layers.{}.fc1", "decoder.layers.{}.fc2"),
}


class OffloadWeights(ResidentWeights):
    """A layer store's tensors by Hugging Face name, as ResidentWeights gives a flash store's: the resident ones
    read (in `dtype`, norms float32), each decoder-layer matrix an OffloadedWeight."""

    def __init__(self, store: LayerStore, dtype: torch.dtype):
        self.store, self.dtype = store, dtype
        self.names = {name.removeprefix("model."): name for name in store.resident_names()}
        self.matrices = {
            e.name.removeprefix("model."): (layer, e.name)
            for layer, entries in enumerate(store.layers)
            for e in entries
        }

    def get(self, name: str, dtype: torch.dtype | None = None) -> Weight | None:
        matrix = self.matrices.pop(name.removeprefix("model."), None)
        if matrix is not None:
            return OffloadedWeight(matrix[0], [matrix[1]])
        return super().get(name, dtype)

    def left(self) -> list[str]:
        return sorted([*self.names.values(), *(name for _, name in self.matrices.values())])


class EndorMatmul:
    """An Endor matrix of an offloaded layer, multiplied by the runtime (OffloadRuntime.linear: endor_linear for a
    few tokens, block-wise decompression and a GEMM for more, by its `compute`)."""

    def __init__(self, runtime: OffloadRuntime, tensor: endor.EndorTensor):
        self.runtime, self.tensor = runtime, tensor

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.runtime.linear(x, self.tensor, bias)


def _back_to_back(parts: Sequence[torch.Tensor]) -> bool:
    """Whether contiguous matrices of one dtype and width lie one after another in one storage."""
    first = parts[0]
    if any(p.dtype != first.dtype or p.shape[1:] != first.shape[1:] or not p.is_contiguous() for p in parts):
        return False
    if any(p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for p in parts):
        return False
    return all(b.data_ptr() == a.data_ptr() + a.nbytes for a, b in zip(parts, parts[1:]))


def _stacked(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The rows of `parts` as one matrix: a view where they lie back to back, else a copy."""
    if len(parts) == 1:
        return parts[0]
    if _back_to_back(parts):
        rows = sum(p.shape[0] for p in parts)
        return parts[0].as_strided((rows, *parts[0].shape[1:]), parts[0].stride())
    return torch.cat(list(parts))


def fused_weight(runtime: OffloadRuntime, weight: OffloadedWeight) -> Weight:
    """The runtime's weights of `weight.names` (its layer in memory or in a slot) as the decoder multiplies them:
    one float matrix or one QuantizedWeight of their rows (a view where possible), or, where an Endor matrix is
    among them, each part on its own (a tuple, EndorMatmul for the Endor ones)."""
    parts = [runtime.weight(weight.layer, name) for name in weight.names]
    if all(isinstance(p, torch.Tensor) for p in parts):
        return _stacked(parts)
    if all(isinstance(p, QuantizedWeight) for p in parts) and len({(p.fmt, p.cols) for p in parts}) == 1:
        return QuantizedWeight(_stacked([p.blocks for p in parts]), parts[0].fmt, parts[0].cols)
    if all(isinstance(p, QuantizedWeight) for p in parts):
        return QuantizedWeight.cat(parts)
    wrapped = tuple(EndorMatmul(runtime, p) if isinstance(p, endor.EndorTensor) else p for p in parts)
    return wrapped[0] if len(wrapped) == 1 else wrapped


def offloaded_attributes(*parts: object) -> list[tuple[object, str, OffloadedWeight]]:
    """(object, attribute, weight) for every OffloadedWeight attribute of `parts` (a layer and its FFN)."""
    return [(obj, name, w) for obj in parts for name, w in vars(obj).items() if isinstance(w, OffloadedWeight)]


class OffloadedLayer:
    """A family model's decoder layer whose matrices the runtime provides: before each forward the layer's are put
    in place (an SSD layer's: the views over the slot it was read into, made once per slot), and the runtime's
    before_layer / after_layer run around it (fetches, timing)."""

    def __init__(self, layer, ffn: DenseFFN, runtime: OffloadRuntime, index: int):
        self.layer, self.runtime, self.index = layer, runtime, index
        self.attributes = offloaded_attributes(layer, ffn)
        self.bound: dict[int, list[Weight]] = {}  # slot -> the weights, in self.attributes' order

    def tensors(self) -> list[torch.Tensor | None]:
        return self.layer.tensors()

    def ffn_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer.ffn_input(x)

    def __call__(self, x: torch.Tensor, ffn: DenseFFN, *args) -> torch.Tensor:
        self.runtime.before_layer(self.index)
        slot = self.runtime.slot_of(self.index)
        if slot is not None:
            weights = self.bound.get(slot)
            if weights is None:
                weights = self.bound[slot] = [fused_weight(self.runtime, w) for _, _, w in self.attributes]
            for (obj, name, _), weight in zip(self.attributes, weights):
                setattr(obj, name, weight)
        x = self.layer(x, ffn, *args)
        self.runtime.after_layer(self.index)
        return x


class OffloadDecoder(LeanDecoder):
    """A LeanDecoder whose decoder layers an OffloadRuntime places (see the module doc). Built by
    load_offload_decoder."""

    runtime: OffloadRuntime

    @property
    def accounted_bytes(self) -> int:
        """DRAM the decoder holds: resident tensors, RoPE tables, KV cache, in-memory layers and the slots."""
        return self.runtime.accounted_bytes

    def stats(self) -> dict:
        """Per token: wall ms and the runtime's stats (OffloadRuntime.stats: read, decompress and layer compute ms,
        bytes and reads, the placement), `other_ms` the rest (embedding, LM head, Python between layers)."""
        out = self._stats_head()
        out.update({k: v for k, v in self.runtime.stats().items() if k not in out})
        out["other_ms"] = out["ms_per_token"] - out["read_ms"] - out["decompress_ms"] - out["compute_ms"]
        out["kv_bytes"] = self.cache.nbytes
        return out


def _ffn(config: DecoderConfig, weights: OffloadWeights, layer: int, activation: str) -> DenseFFN:
    gate, up, down = (None if name is None else name.format(layer) for name in FFN_MATRICES[config.family])
    w_in = weights.require(f"{up}.weight")
    b_in = weights.get(f"{up}.bias")
    if gate is not None:
        w_in = cat_rows([weights.require(f"{gate}.weight"), w_in])
        gate_bias = weights.get(f"{gate}.bias")
        b_in = None if b_in is None else torch.cat((gate_bias, b_in))
    return DenseFFN(
        w_in, weights.require(f"{down}.weight"), b_in, weights.get(f"{down}.bias"), gate is not None, activation
    )


def _resident_bytes(model: FamilyModel, ffns: Sequence[DenseFFN]) -> int:
    """The bytes of the model's tensors outside the decoder layers' matrices (the FFN biases included), before the
    runtime put any in place."""
    tensors = [*model.tensors(), *(t for ffn in ffns for t in (ffn.b_in, ffn.b_out))]
    return tensor_bytes(t for t in tensors if isinstance(t, (torch.Tensor, QuantizedWeight)))


def load_offload_decoder(
    store_dir: str | os.PathLike,
    dram_budget: int | float | str | None = "30%",
    *,
    mode: str | None = None,
    compute: str = "auto",
    threads: int = 32,
    layers_in_memory: int | None = None,
    layers_on_device: int | None = None,
    slots: int | None = None,
    max_len: int = 2048,
    kv_dtype: torch.dtype = torch.float16,
    progress: bool = True,
) -> OffloadDecoder:
    """An OffloadDecoder over a layer store, on the CPU: its decoder layers in memory or on SSD by `dram_budget`
    (bytes, "30%" of the model's weights, "2GB"; None: no limit), which also charges the RoPE tables and the KV cache
    of max_len tokens (kv_dtype). mode, compute, threads, layers_in_memory, layers_on_device, slots and progress as
    load_offload's (on a GPU, load_offload's transformers model runs the store). ValueError for a model family the
    lean decoder does not run, or a mixture-of-experts store, naming it."""
    store, mode = open_layer_store(
        store_dir,
        mode,
        compute=compute,
        threads=threads,
        slots=slots,
        layers_in_memory=layers_in_memory,
        layers_on_device=layers_on_device,
    )
    try:
        config = DecoderConfig.from_config(store.config, store.path)
        if config.n_experts:
            raise ValueError(
                f"{store.path}: a mixture-of-experts layer store runs through transformers only (load_offload); "
                "a flash store runs its experts on the lean decoder (load_decoder)"
            )
        weights = OffloadWeights(store, store.dtype)
        model = FAMILY_MODELS[config.family](config, weights, max_len)
        activation = config_activation(store.config)
        ffns = [_ffn(config, weights, layer, activation) for layer in range(config.n_layers)]
        if weights.left():
            raise ValueError(
                f"{store.path}: tensors the {config.model_type} decoder has no place for: {weights.left()[:4]}"
            )
        store.close_resident()
        cache = StaticKVCache(config.n_layers, max_len, config.n_kv_heads, config.head_dim, kv_dtype, "cpu")
        tables = model_table_bytes(model)
        resident = _resident_bytes(model, ffns) - tables
        runtime = offload_runtime(
            store,
            mode,
            dram_budget,
            resident,
            compute,
            threads,
            torch.device("cpu"),
            held=tables + cache.nbytes,
            layers_in_memory=layers_in_memory,
            layers_on_device=layers_on_device,
            slots=slots,
            progress=progress,
        )
    except BaseException:
        store.close_resident()
        raise
    for index in range(runtime.layers_on_device):  # their weights once, fused; the runtime's copies let go
        for obj, name, weight in offloaded_attributes(model.layers[index], ffns[index]):
            setattr(obj, name, fused_weight(runtime, weight))
        runtime.memory[index].clear()
    model.layers = [OffloadedLayer(layer, ffn, runtime, i) for i, (layer, ffn) in enumerate(zip(model.layers, ffns))]
    model_bytes = resident + sum(store.dense_bytes(i) for i in range(store.n_layers))
    return OffloadDecoder(store, config, model, ffns, cache, mode, runtime, model_bytes)
