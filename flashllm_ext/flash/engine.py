"""The engine: a Hugging Face causal LM whose FFNs are served from a flash store within a DRAM budget.

    model = flashllm_ext.load_flash(store_dir, dram_budget="50%", mode="flash")   # builds the model from the store
    runtime = flashllm_ext.patch_flash(model, store_dir, mode="flash")           # or patches a loaded model
    model.generate(...); model.flash.stats(); runtime.unpatch(model)

Modes (the paper's Table 3 rows):
  dense   every weight in DRAM, the FFNs as nn.Linear: the reference (no budget applies)
  naive   every FFN bundle re-read from flash for every forward (one staging buffer shared by the layers)
  hybrid  as many bundles of each layer resident as the budget allows, the rest re-read every forward
  flash   predictor + sliding-window NeuronCache + coalesced parallel direct reads of the missing bundles
  exact   flash's cache and reads with every neuron active and no threshold: dense results through the flash path

The budget covers what the model holds: resident tensors (embeddings, attention, norms), predictors, the caches /
resident bundles / staging buffers, and the reader's own buffers (FlashReader.buffer_bound: a bounce buffer per
worker thread, an Endor store's compressed staging). Its
split: resident tensors first, then predictors, then the FFN state, equal per layer. A budget that cannot hold one
bundle per layer raises ValueError naming the minimum. Where a layer's share would hold less than a token's set
(the predictors' loaded density of its neurons), flash and exact mode give every layer one shared NeuronCache in
turn (CACHE_LAYOUTS), its per-neuron state held once and half the FFN budget left to the reader's buffers: no hits
across tokens, but a set is read and computed in a few large parts rather than in thousands of tiny ones.

device="cuda" puts the model, the caches (flashllm_ext/flash/transfer.py) and the resident bundles on the GPU; the budget
then sizes them as on the CPU (what the model holds, wherever), and the host keeps the cache's planning state and
one pinned staging buffer shared by every layer (counted in ffn_bytes).
"""

from __future__ import annotations

import os
from functools import partial

import torch
from torch import nn

from flashllm_ext.flash.ffn import LOOKAHEAD_MODES, FlashFFN
from flashllm_ext.flash.install import ffn_slots, set_ffn
from flashllm_ext.flash.half_linear import use_half_linears
from flashllm_ext.hub.hf import ffn_norm
from flashllm_ext.flash.reader import FlashReader
from flashllm_ext.flash.store import FlashStore
from flashllm_ext.runtime import cuda_device
from flashllm_ext.hub.hf import assign_resident, empty_model, refuse_missing_tensors
from flashllm_ext.runtime import deprecated_alias, parse_budget, tensor_bytes
from flashllm_ext.flash.expert_blocks import install_experts
from flashllm_ext.flash.stack import MODES, FlashRuntime, ffn_stack, refuse_experts, store_ffn_bytes


def _ffn_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for _, modules in ffn_slots(model) for m in modules.values() for name, p in m.named_parameters()]


def resident_bytes_of(model: nn.Module) -> int:
    """Bytes of the model's own tensors outside its FFNs (meta tensors count nothing)."""
    ffn = {id(p) for _, p in _ffn_parameters(model)}
    return tensor_bytes([p for p in model.parameters() if id(p) not in ffn] + list(model.buffers()))


def _check_model_matches(
    model: nn.Module, store: FlashStore, slots: list[tuple[nn.Module, dict[str, nn.Module]]]
) -> None:
    if len(slots) != store.n_layers:
        raise ValueError(
            f"{type(model).__name__} has {len(slots)} decoder layers, the store {store.path} has {store.n_layers}"
        )
    hidden = getattr(model.config, "hidden_size", None) or getattr(model.config, "word_embed_proj_dim", None)
    ffn = getattr(model.config, "intermediate_size", None) or getattr(model.config, "ffn_dim", None)
    if (hidden, ffn) != (store.hidden_size, store.n_neurons):
        raise ValueError(
            f"the model has hidden size {hidden} and {ffn} FFN neurons, the store {store.path} "
            f"{store.hidden_size} and {store.n_neurons}: not the same model"
        )


def _install(
    model: nn.Module,
    store: FlashStore,
    mode: str,
    budget_bytes: int | None,
    window: int,
    predictors: nn.Module | None,
    threads: int,
    keep_originals: bool,
    device: torch.device,
    reader_options: dict | None = None,
    lookahead: str | None = None,
    cache_layout: str = "auto",
) -> FlashRuntime:
    if mode == "dense":
        raise ValueError("dense mode keeps the model's own FFNs: nothing to install")
    cache_layout = check_lookahead(mode, lookahead, cache_layout)
    slots = ffn_slots(model)
    _check_model_matches(model, store, slots)
    runtime = ffn_stack(
        store,
        mode,
        budget_bytes,
        window=window,
        predictors=predictors,
        threads=threads,
        resident_bytes=resident_bytes_of(model),
        device=device,
        reader_options=reader_options,
        lookahead=lookahead or "ahead",
        cache_layout=cache_layout,
    )
    if keep_originals:
        runtime.originals = [(layer, dict(mods)) for layer, mods in slots]
    for (layer, _), module in zip(slots, runtime.modules):
        set_ffn(layer, module)
        if lookahead:
            runtime.hooks.append(
                layer.register_forward_pre_hook(partial(_look_ahead, module, ffn_norm(layer)), with_kwargs=True)
            )
    runtime.install_on(model)
    return runtime


def check_lookahead(mode: str, lookahead: str | None, cache_layout: str) -> str:
    """ValueError for a mode or a look-ahead the engine does not run, or a look-ahead without per-layer caches;
    returns the cache layout to build ("auto" is "per-layer" when look-ahead is on)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if lookahead is not None and lookahead not in LOOKAHEAD_MODES:
        raise ValueError(f"lookahead must be None or one of {LOOKAHEAD_MODES}, got {lookahead!r}")
    if lookahead and mode not in ("flash", "exact"):
        raise ValueError(f"lookahead needs a neuron cache (flash or exact mode), not {mode} mode")
    if lookahead and cache_layout == "shared":
        raise ValueError(
            "lookahead needs per-layer caches (a prefetched set must stay in its layer's rows), not "
            "cache_layout='shared'"
        )
    return "per-layer" if lookahead and cache_layout == "auto" else cache_layout


def _look_ahead(ffn: FlashFFN, norm: nn.Module, _layer: nn.Module, args: tuple, kwargs: dict) -> None:
    """Before a decoder layer's attention, for one token: its FFN's set chosen from the normed layer input and the
    reads begun (FlashFFN.prefetch), so they run while the attention computes."""
    hidden = args[0] if args else kwargs["hidden_states"]
    if hidden.shape[:-1].numel() == 1:
        ffn.prefetch(norm(hidden))


def model_bytes(model: nn.Module, store: FlashStore) -> int:
    """What the whole model weighs: its resident tensors, its FFN biases and every FFN bundle of the store."""
    biases = [p for name, p in _ffn_parameters(model) if name.endswith("bias")]
    return resident_bytes_of(model) + tensor_bytes(biases) + store_ffn_bytes(store)


def predictors_for_mode(store: FlashStore, predictors, mode: str):
    if mode != "flash" or predictors is not None:
        return predictors
    from flashllm_ext.predictor import load_predictors, predictors_recipe

    try:
        predictors = load_predictors(store.path)
    except Exception as e:  # FormatError: no predictors in the store
        raise ValueError(
            f"flash mode needs predictors and {store.path} has none usable ({e}); train them with "
            f"`flashllm train-predictors CHECKPOINT --store {store.path}`"
        ) from None
    if predictors.loaded_density is None:  # saved before predictors kept it: their recipe's target, if any
        density = (predictors_recipe(store.path) or {}).get("density")
        predictors.loaded_density = None if density is None else float(density)
    return predictors


def patch_flash(
    model: nn.Module,
    store: FlashStore | str | os.PathLike,
    *,
    mode: str = "flash",
    dram_budget: int | float | str | None = None,
    window: int = 5,
    predictors=None,
    threads: int = 32,
    lookahead: str | None = None,
    cache_layout: str = "auto",
) -> FlashRuntime:
    """Serve the FFNs of an already loaded Llama-family or OPT model from `store` (converted from the same
    checkpoint). The original FFN modules are kept for `unpatch` (so they still occupy memory: for a real budget
    use load_flash). dram_budget (default: none) bounds what the engine accounts, as in load_flash. The FFNs go on
    the device of the model's parameters. Returns the runtime; `model.flash.stats()` reports the costs;
    `runtime.unpatch(model)` restores the model. lookahead, cache_layout: as in load_flash."""
    store = store if isinstance(store, FlashStore) else FlashStore(store)
    refuse_experts(store)
    if getattr(model, "flash", None) is not None:
        raise ValueError("this model is already patched: unpatch it first")
    predictors = predictors_for_mode(store, predictors, mode)
    budget = None if dram_budget is None else parse_budget(dram_budget, model_bytes(model, store))
    device = cuda_device(next(model.parameters()).device)
    return _install(
        model,
        store,
        mode,
        budget,
        window,
        predictors,
        threads,
        keep_originals=True,
        device=device,
        lookahead=lookahead,
        cache_layout=cache_layout,
    )


def load_flash(
    store_dir: str | os.PathLike,
    dram_budget: int | float | str | None = "50%",
    *,
    mode: str = "flash",
    window: int = 5,
    predictors=None,
    dtype: torch.dtype | None = None,
    threads: int = 32,
    device: str | torch.device = "cpu",
    reader_options: dict | None = None,
    lookahead: str | None = None,
    cache_layout: str = "auto",
    expert_policy: str = "lru",
) -> nn.Module:
    """A Hugging Face causal LM built from a flash store, its FFNs served by `mode` within `dram_budget` (bytes,
    "50%" of the model, or "200MB"; None: no limit). Only resident tensors are materialised (in `dtype`, default
    the store's); in dense
    mode the FFN weights are read from the store into ordinary nn.Linear layers. Predictors come from the store
    unless given. `model.flash.stats()` reports per-token costs. device: "cpu" or "cuda" (the whole model, its
    caches included, on the GPU; ValueError when CUDA is not available). threads and reader_options (e.g.
    {"max_gap": 0, "min_read": 0}): the FlashReader's. The model's half-precision nn.Linear layers become
    HalfLinear (flashllm_ext/flash/half_linear.py: the native half_linear kernel on the CPU, F.linear elsewhere).
    lookahead (flash / exact; None: off): before each decoder layer's attention in a decode step, a set for its
    FFN is chosen from the layer's input through the FFN's norm and its reads run during the attention
    (FlashFFN.prefetch, as DejaVu predicts ahead). "ahead": the FFN computes that set (predicted from an input one
    attention earlier: fewer exposed reads, lower recall); "prefetch": the FFN computes the set its predictor
    chooses from its own input, as without look-ahead, and reads only what the prefetch missed (the same results,
    a second predictor pass). docs/benchmarks/bench_e2e_scale.md measures both. cache_layout (flash / exact,
    CACHE_LAYOUTS): "per-layer" caches (the paper's), "shared" (one row matrix the layers use in turn), "hot-cold"
    (per-layer caches that pin the neurons the predictors' calibration found most often active, the split chosen by
    flashllm_ext.flash.hot_cold), or "auto": shared when a per-layer cache would hold less than the predictors'
    loaded density of a layer's neurons, and no look-ahead is asked for; `model.flash.stats()["cache_layout"]`
    says which (and "hot_fraction" how much is pinned).

    A mixture-of-experts store runs in dense, naive or flash mode with its experts in per-layer caches by
    `expert_policy` (flashllm_ext.flash.experts; no predictors: each block's own router names its experts), on the
    CPU and without look-ahead (the lean decoder, load_decoder, reads the next layer's experts ahead)."""
    device = cuda_device(device)
    store = FlashStore(store_dir)
    dtype = dtype or store.dtype
    if store.experts is not None:
        return _load_experts(
            store, dram_budget, mode, window, dtype, threads, device, reader_options, lookahead, expert_policy
        )
    model = empty_model(store.config, dtype, store.path)
    predictors = predictors_for_mode(store, predictors, mode)
    assign_resident(model, store, dtype, keep_blocks=True)  # a quantized store's blocks stay blocks
    if mode == "dense":
        _assign_dense_ffn(model, store, dtype)
        model.flash = None
    else:
        budget = None if dram_budget is None else parse_budget(dram_budget, model_bytes(model, store))
        _install(
            model,
            store,
            mode,
            budget,
            window,
            predictors,
            threads,
            keep_originals=False,
            device=device,
            reader_options=reader_options,
            lookahead=lookahead,
            cache_layout=cache_layout,
        )
        store.close_resident()  # the FFNs read their biases from it
    refuse_missing_tensors(model, store)
    use_half_linears(model)  # the resident half-precision linears through flashllm::half_linear on the CPU
    return model.to(device).eval()


def _load_experts(
    store: FlashStore,
    dram_budget: int | float | str | None,
    mode: str,
    window: int,
    dtype: torch.dtype,
    threads: int,
    device: torch.device,
    reader_options: dict | None,
    lookahead: str | None,
    expert_policy: str,
) -> nn.Module:
    """load_flash of a mixture-of-experts store: the model's resident tensors, its blocks' experts from the store."""
    if device.type != "cpu" or lookahead is not None:
        store.close()
        raise ValueError(
            f"{store.path}: a mixture-of-experts store runs on the CPU without look-ahead in load_flash "
            "(load_decoder reads the next layer's experts ahead)"
        )
    try:
        model = empty_model(store.config, dtype, store.path)
        assign_resident(model, store, dtype)
        resident = tensor_bytes([p for p in model.parameters() if p.device.type != "meta"] + list(model.buffers()))
        budget = None if dram_budget is None else parse_budget(dram_budget, resident + store_ffn_bytes(store))
        install_experts(
            model,
            store,
            mode,
            budget,
            resident_bytes=resident,
            policy=expert_policy,
            window=window,
            threads=threads,
            reader_options=reader_options,
        )
        refuse_missing_tensors(model, store)
    except BaseException:
        store.close()
        raise
    use_half_linears(model)
    return model.eval()


def _assign_dense_ffn(model: nn.Module, store: FlashStore, dtype: torch.dtype) -> None:
    """FFN weights of every layer from the store's bundles into the model's own Linear layers."""
    d = store.hidden_size
    with FlashReader(store) as reader:
        for i, (layer, modules) in enumerate(ffn_slots(model)):
            bundles = store.float_rows(reader.read(i, torch.arange(store.n_neurons)).data).to(dtype)
            up, down = bundles[:, :d], bundles[:, -d:].t()
            if "mlp" in modules:
                mlp = modules["mlp"]
                weights = {mlp.up_proj: up, mlp.down_proj: down}
                if store.glu:
                    weights[mlp.gate_proj] = bundles[:, d : 2 * d]
            else:
                weights = {modules["fc1"]: up, modules["fc2"]: down}
            for linear, w in weights.items():
                linear.weight = nn.Parameter(w.contiguous(), requires_grad=False)


patch_model = deprecated_alias(patch_flash, "patch_model", "patch_flash")
