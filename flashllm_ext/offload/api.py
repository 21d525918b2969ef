"""load_offload and patch_offload: a model whose decoder layers are offloaded (see flashllm_ext.offload)."""

from __future__ import annotations

import os
from functools import partial

import torch
from torch import nn
from tqdm.auto import tqdm

from flashllm_ext import endor
from flashllm_ext.runtime import tensor_bytes, parse_budget
from flashllm_ext.hub.hf import assign_resident, empty_model, refuse_missing_tensors
from flashllm_ext.hub.hf import decoder_layers
from flashllm_ext.flash.reader import FlashReader, host_bounce_bytes, select_read_path
from flashllm_ext.io.safetensors import drop_page_cache
from flashllm_ext.io.buffers import aligned_buffer, pinned_buffer
from flashllm_ext.runtime import cuda_device
from flashllm_ext.offload.placement import BudgetTooSmall, check_options, default_slots, plan_placement, store_mode
from flashllm_ext.offload.runtime import OffloadedLinear, OffloadRuntime
from flashllm_ext.offload.store import LayerStore
from flashllm_ext.runtime import deprecated_alias


def _linear_slots(model: nn.Module, store: LayerStore) -> list[list[tuple[nn.Module, str, nn.Linear, str]]]:
    """Per decoder layer: (parent module, attribute, the Linear, its weight's checkpoint name), matched one to one
    with the store's matrices of that layer."""
    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: not a Llama-family or OPT causal LM (no decoder layers found)")
    if len(layers) != store.n_layers:
        raise ValueError(
            f"{type(model).__name__} has {len(layers)} decoder layers, the store {store.path} has {store.n_layers}"
        )
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for i, layer in enumerate(layers):
        prefix = names[id(layer)]
        slots = []
        for sub, module in layer.named_modules():
            if isinstance(module, (nn.Linear, OffloadedLinear)):
                parent_name, _, attr = sub.rpartition(".")
                slots.append(
                    (layer.get_submodule(parent_name) if parent_name else layer, attr, module, f"{prefix}.{sub}.weight")
                )
        want = {e.name: e.shape for e in store.layers[i]}
        have = {s[3]: (s[2].out_features, s[2].in_features) for s in slots}
        if want != have:
            raise ValueError(
                f"layer {i}: the model's Linear weights {sorted(have.items())[:4]} differ from the "
                f"store's {sorted(want.items())[:4]} ({store.path}): not the same model"
            )
        out.append(slots)
    return out


def _install(
    model: nn.Module,
    store: LayerStore,
    mode: str,
    budget: int | float | str | None,
    compute: str,
    threads: int,
    keep_originals: bool,
    device: torch.device,
    layers_in_memory: int | None = None,
    device_budget: int | float | str | None = None,
    layers_on_device: int | None = None,
    slots: int | None = None,
    progress: bool = False,
) -> OffloadRuntime:
    if getattr(model, "offload", None) is not None:
        raise ValueError("this model is already offloaded: unpatch it first")
    linear_slots = _linear_slots(model, store)
    params = [p for p in model.parameters() if p.device.type != "meta" and p.is_floating_point()]
    if params and params[0].dtype != store.dtype:
        raise ValueError(
            f"the model is {params[0].dtype}, the store {store.path} {store.dtype}: load the model in the store's dtype"
        )
    weights = {id(s[2].weight) for layer in linear_slots for s in layer if isinstance(s[2], nn.Linear)}
    resident = tensor_bytes([p for p in model.parameters() if id(p) not in weights] + list(model.buffers()))
    runtime = offload_runtime(
        store,
        mode,
        budget,
        resident,
        compute,
        threads,
        device,
        layers_in_memory=layers_in_memory,
        device_budget=device_budget,
        layers_on_device=layers_on_device,
        slots=slots,
        progress=progress,
    )
    for i, layer_slots in enumerate(linear_slots):
        for parent, attr, linear, name in layer_slots:
            if keep_originals:
                runtime.originals.append((parent, attr, linear))
            entry = next(e for e in store.layers[i] if e.name == name)
            setattr(parent, attr, OffloadedLinear(runtime, i, name, entry.shape, linear.bias))
    for i, layer in enumerate(decoder_layers(model)):
        runtime.hooks.append(layer.register_forward_pre_hook(lambda _m, _a, i=i: runtime.before_layer(i)))
        runtime.hooks.append(layer.register_forward_hook(lambda _m, _a, _o, i=i: runtime.after_layer(i)))
    runtime.install_on(model)
    return runtime


def offload_runtime(
    store: LayerStore,
    mode: str,
    budget: int | float | str | None,
    resident: int,
    compute: str,
    threads: int,
    device: torch.device,
    *,
    held: int = 0,
    layers_in_memory: int | None = None,
    device_budget: int | float | str | None = None,
    layers_on_device: int | None = None,
    slots: int | None = None,
    progress: bool = False,
) -> OffloadRuntime:
    """The runtime of a model whose tensors outside the decoder layers' matrices take `resident` bytes, beside
    `held` bytes of buffers that are no weights (a lean decoder's KV cache and RoPE tables): the layers placed by the
    budgets (a percentage is of resident + the layers' dense bytes; both charge resident + held), the reader of the
    SSD layers, the staged layers' stored bytes and the in-memory layers' weights (`runtime.memory`) read.
    ValueError naming the budget when it cannot hold the minimum. The other arguments as load_offload's."""
    separate = device.type == "cuda"
    slots = default_slots(device) if slots is None else slots
    if device_budget is not None and not separate:
        raise ValueError(
            "device_budget is the GPU memory for layers on a CUDA device; on the CPU dram_budget is the one budget"
        )
    model_bytes = resident + sum(store.dense_bytes(i) for i in range(store.n_layers))
    resident += held
    budget_bytes = None if budget is None else parse_budget(budget, model_bytes)
    device_budget_bytes = None if device_budget is None else parse_budget(device_budget, model_bytes, "device_budget")
    # On the CPU the resident tensors share the one budget with the layers; on a GPU they live in device memory.
    host_layer_budget = None if budget_bytes is None else budget_bytes - (0 if separate else resident)
    device_layer_budget = None if device_budget_bytes is None else device_budget_bytes - resident
    read_path = select_read_path(device)
    try:
        placement = plan_placement(
            store,
            mode,
            host_layer_budget,
            layers_in_memory,
            device_layer_budget=device_layer_budget,
            separate=separate,
            bounce=partial(host_bounce_bytes, read_path, threads=threads) if separate else None,
            layers_on_device=layers_on_device,
            slots=slots,
        )
    except BudgetTooSmall as e:
        if e.pool == "device":
            raise ValueError(
                f"device_budget of {device_budget_bytes} bytes is below the minimum of "
                f"{resident + e.need} for {mode} offload on {device} ({resident} resident tensors + "
                f"{e.need} for {slots} slot(s) of the largest layer and the decompression buffer)"
            ) from None
        if separate:
            raise ValueError(
                f"dram_budget of {budget_bytes} bytes is below the minimum of {e.need} for {mode} "
                f"offload to {device} (the pinned host memory SSD reads pass through on the "
                f"{read_path!r} read path)"
            ) from None
        raise ValueError(
            f"dram_budget of {budget_bytes} bytes is below the minimum of {resident + e.need} for "
            f"{mode} offload ({resident} resident tensors + {e.need} for {slots} staging buffer(s) of the "
            f"largest layer and the decompression buffer)"
        ) from None
    runtime = OffloadRuntime(
        store, mode, compute, device, budget_bytes, device_budget_bytes, resident, placement, threads
    )
    if runtime.moved_layers:  # the staged layers are read once here, the SSD ones every forward
        runtime.reader = FlashReader.for_file(store.layers_path, threads=threads)
    for i in tqdm(
        range(placement.in_memory),
        desc="loading layers into memory",
        unit="layer",
        disable=not progress or not placement.in_memory,
    ):
        if i >= placement.on_device:  # staged: the stored bytes, pinned on CUDA
            size = store.layer_range(i)[1]
            host = pinned_buffer(size) if separate else aligned_buffer(size)
            runtime.read_layer(i, host)
            runtime.host_layers.append(host)
            continue
        layer = {}  # resident: dense (dense, endor), or as stored (endor+more-resident)
        for e in store.layers[i]:
            w = store.matrix(i, e.name)
            w = w.decompress() if isinstance(w, endor.EndorTensor) and mode != "endor+more-resident" else w
            layer[e.name] = w.to(device)
        runtime.memory.append(layer)
    if placement.in_memory:
        drop_page_cache(store.layers_path)
    return runtime


def patch_offload(
    model: nn.Module,
    store: LayerStore | str | os.PathLike,
    *,
    mode: str | None = None,
    dram_budget: int | float | str | None = None,
    compute: str = "auto",
    threads: int = 32,
    device_budget: int | float | str | None = None,
    slots: int | None = None,
) -> OffloadRuntime:
    """Offload the decoder layers of an already loaded Llama-family or OPT model (in the store's dtype, on the CPU
    or a CUDA device: the layers are computed where the model is) to `store` (converted from the same weights). The
    original Linear modules are kept for `unpatch`, so they still occupy memory: for a real budget use
    load_offload. mode: as load_offload's. Returns the runtime; `runtime.unpatch(model)` restores the model."""
    store, mode = open_layer_store(store, mode, compute=compute, threads=threads, slots=slots)
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    return _install(
        model,
        store,
        mode,
        dram_budget,
        compute,
        threads,
        keep_originals=True,
        device=cuda_device(device),
        device_budget=device_budget,
        slots=slots,
    )


def open_layer_store(store: LayerStore | str | os.PathLike, mode: str | None, **options) -> tuple[LayerStore, str]:
    """The layer store (opened at `store` unless it is one) and the mode it runs in (`mode`, or the store's own:
    store_mode), the mode and load options (check_options' keywords) checked before any weight is read."""
    store = store if isinstance(store, LayerStore) else LayerStore(store)
    mode = store_mode(store) if mode is None else mode
    check_options(store, mode, **options)
    return store, mode


def load_offload(
    store_dir: str | os.PathLike,
    dram_budget: int | float | str | None = "30%",
    *,
    mode: str | None = None,
    compute: str = "auto",
    threads: int = 32,
    layers_in_memory: int | None = None,
    device: str | torch.device = "cpu",
    device_budget: int | float | str | None = None,
    layers_on_device: int | None = None,
    slots: int | None = None,
    progress: bool = True,
) -> nn.Module:
    """A Hugging Face causal LM built from a layer store, computed on `device` ("cpu" or "cuda").

    On the CPU its decoder layers are in memory or on SSD by `dram_budget` (bytes, "30%" of the dense model, or
    "2GB"; None: no limit): the most layers that fit, or `layers_in_memory` (e.g. another mode's placement, to
    compare on the same one; ValueError if it does not fit). On CUDA, as Endor does, the resident tensors and the
    first layers live in GPU memory by `device_budget` (None: all of them), the next ones in host memory by
    `dram_budget` (as stored: compressed in the Endor modes, copied to the GPU and decompressed there for each
    use), the rest on SSD, read straight into GPU memory (kvikio) or through a pinned buffer. `layers_on_device`
    forces the first tier; on the CPU it keeps layers [layers_on_device, layers_in_memory) as stored bytes copied
    into a slot for each use: the GPU's code path, run where there is no GPU (see Placement). `slots`: the buffers
    moved layers are fetched into, charged to the device's budget (the one budget on the CPU): two (the next
    layer's fetch overlaps this layer's compute) or one (a layer's room more, for a device whose compute is short
    beside a fetch); None: default_slots(device). Only the resident tensors and the placed layers are materialised,
    in the store's dtype (a quantized store's embedding and LM head as its blocks: hub.hf.QuantizedEmbedding /
    QuantizedLinear); a progress bar while the layers load, unless progress=False. mode: one of MODES; None: the
    store's own, endor for an Endor store and dense otherwise. `model.offload.stats()` reports per-token costs."""
    store, mode = open_layer_store(
        store_dir,
        mode,
        compute=compute,
        threads=threads,
        slots=slots,
        layers_in_memory=layers_in_memory,
        layers_on_device=layers_on_device,
    )
    device = cuda_device(device)
    model = empty_model(store.config, store.dtype, store.path)
    assign_resident(model, store, store.dtype, keep_blocks=True)
    _install(
        model,
        store,
        mode,
        dram_budget,
        compute,
        threads,
        keep_originals=False,
        device=device,
        layers_in_memory=layers_in_memory,
        device_budget=device_budget,
        layers_on_device=layers_on_device,
        slots=slots,
        progress=progress,
    )
    refuse_missing_tensors(model, store)
    return model.to(device).eval()


load_offloaded = deprecated_alias(load_offload, "load_offloaded", "load_offload")
