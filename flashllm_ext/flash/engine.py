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
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from flashllm_ext.flash.cache import NeuronCache, input_bias_role
from flashllm_ext.flash.ffn import LOOKAHEAD_MODES, FFNStats, FlashFFN, StreamingFFN, ffn_slots, set_ffn
from flashllm_ext.flash.half_linear import use_half_linears
from flashllm_ext.hub.hf import ffn_norm
from flashllm_ext.flash.reader import DEFAULT_MAX_READ, FlashReader
from flashllm_ext.flash.store import FlashStore
from flashllm_ext.flash.transfer import Transfer, make_transfer
from flashllm_ext.runtime import cuda_device
from flashllm_ext.hub.hf import assign_resident, empty_model
from flashllm_ext.runtime import Runtime, deprecated_alias, parse_budget, tensor_bytes


MODES = ("dense", "naive", "hybrid", "flash", "exact")
# How flash / exact mode lays out its caches: one per layer (the paper's: hits across tokens), or one NeuronCache that
# every layer uses in turn (no hits; for budgets whose per-layer caches would hold less than a token's set, which
# they would then read and compute in many small parts). "auto": shared exactly then, judged by the
# predictors' calibrated loaded density (per-layer when it is unknown).
CACHE_LAYOUTS = ("auto", "per-layer", "shared")


def store_ffn_bytes(store: FlashStore) -> int:
    return store.n_layers * store.n_neurons * store.row_bytes


@dataclass
class FlashRuntime(Runtime):
    """What the engine installed in a model: mode, budget split, modules and their accumulated stats."""

    store: FlashStore
    mode: str
    budget_bytes: int | None
    resident_bytes: int  # the model's own tensors outside the FFNs
    predictor_bytes: int
    ffn_bytes: int  # caches / resident bundles / staging
    modules: list[nn.Module]
    counters: FFNStats  # accumulated over every FFN module
    reader: FlashReader | None
    originals: list[tuple[nn.Module, dict[str, nn.Module]]] = field(default_factory=list)
    predictors: nn.Module | None = None
    cache_layout: str | None = None  # flash / exact: "per-layer" or "shared" (CACHE_LAYOUTS); None otherwise
    hooks: list = field(default_factory=list)  # the look-ahead hooks on the decoder layers (removable handles)

    @property
    def accounted_bytes(self) -> int:
        return self.resident_bytes + self.predictor_bytes + self.ffn_bytes

    attribute = "flash"
    built_by = "load_flash"

    def stats(self) -> dict:
        """Per generated/processed token: I/O (exposed, and hidden behind compute; Endor decompression, part of the
        I/O time, also alone), memory-management, predictor and FFN compute milliseconds, bytes read (and the
        bundles' own bytes among them) and cache hit rate, plus the accounted DRAM and the bytes the reader's bounce
        buffers hold now (within its buffer_bound, part of ffn_bytes). A token is counted once per model forward
        position."""
        s, layers = self.counters, max(1, self.store.n_layers)
        tokens = s.tokens // layers
        per = 1e3 / max(tokens, 1)
        return {
            "mode": self.mode,
            "tokens": tokens,
            "io_ms": s.io_s * per,
            "hidden_io_ms": s.hidden_io_s * per,
            "decompress_ms": s.decompress_s * per,
            "mem_ms": s.mem_s * per,
            "predictor_ms": s.predictor_s * per,
            "compute_ms": s.compute_s * per,
            "bytes_per_token": s.bytes_read / max(tokens, 1),
            "bytes_read": s.bytes_read,
            "requested_bytes_per_token": s.bytes_requested / max(tokens, 1),
            "reads_per_token": s.n_reads / max(tokens, 1),
            "mean_read_bytes": s.bytes_read / s.n_reads if s.n_reads else 0.0,
            "hit_rate": s.hit_rate,
            "steps": s.steps,
            "budget_bytes": self.budget_bytes,
            "accounted_bytes": self.accounted_bytes,
            "resident_bytes": self.resident_bytes,
            "predictor_bytes": self.predictor_bytes,
            "ffn_bytes": self.ffn_bytes,
            "cache_layout": self.cache_layout,
            "reader_bounce_bytes": None if self.reader is None else self.reader.bounce_bytes(),
        }

    flash_stats = deprecated_alias(stats, "FlashRuntime.flash_stats()", "FlashRuntime.stats()")

    def _restore_originals(self) -> None:
        for layer, modules in self.originals:
            for name, module in modules.items():
                setattr(layer, name, module)

    def close(self) -> None:
        """Release the reader (and its threads and buffers)."""
        if self.reader is not None:
            self.reader.close()
            self.reader = None


def _ffn_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for _, modules in ffn_slots(model) for m in modules.values() for name, p in m.named_parameters()]


def _resident_bytes(model: nn.Module) -> int:
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
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "dense":
        raise ValueError("dense mode keeps the model's own FFNs: nothing to install")
    if lookahead is not None and lookahead not in LOOKAHEAD_MODES:
        raise ValueError(f"lookahead must be None or one of {LOOKAHEAD_MODES}, got {lookahead!r}")
    if lookahead and mode not in ("flash", "exact"):
        raise ValueError(f"lookahead needs a neuron cache (flash or exact mode), not {mode} mode")
    if lookahead and cache_layout == "shared":
        raise ValueError(
            "lookahead needs per-layer caches (a prefetched set must stay in its layer's rows), not "
            "cache_layout='shared'"
        )
    if lookahead:
        cache_layout = "per-layer"
    slots = ffn_slots(model)
    _check_model_matches(model, store, slots)
    runtime = ffn_stack(
        store,
        mode,
        budget_bytes,
        window=window,
        predictors=predictors,
        threads=threads,
        resident_bytes=_resident_bytes(model),
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


def _look_ahead(ffn: FlashFFN, norm: nn.Module, _layer: nn.Module, args: tuple, kwargs: dict) -> None:
    """Before a decoder layer's attention, for one token: its FFN's set chosen from the normed layer input and the
    reads begun (FlashFFN.prefetch), so they run while the attention computes."""
    hidden = args[0] if args else kwargs["hidden_states"]
    if hidden.shape[:-1].numel() == 1:
        ffn.prefetch(norm(hidden))


def _make_modules(
    store: FlashStore,
    mode: str,
    ffn_budget: int | None,
    window: int,
    predictors,
    reader,
    stats,
    budget_bytes,
    fixed_bytes,
    transfer: Transfer,
    lookahead: str,
    ffn_class: type[FlashFFN] = FlashFFN,
    streaming_class: type[StreamingFFN] = StreamingFFN,
    layout: str | None = None,
) -> tuple[list[nn.Module], int]:
    """(the FFN modules, the bytes they hold); layout: flash / exact mode's, "per-layer" or "shared"."""
    n_layers, n, row = store.n_layers, store.n_neurons, store.row_bytes

    def too_small(need: int) -> ValueError:
        return ValueError(
            f"dram_budget of {budget_bytes} bytes is below the minimum of {fixed_bytes + need} for "
            f"{mode} mode ({fixed_bytes} resident tensors, predictors and read staging + {need} for "
            "the FFNs)"
        )

    if mode in ("flash", "exact"):
        flash, shared, cache = mode == "flash", layout == "shared", None
        fixed, per_row = FlashFFN.bytes_for(store, staged=transfer.staged, every_neuron=not flash)
        per_layer = None if ffn_budget is None else ffn_budget // n_layers
        if transfer.staged and per_layer is not None:  # + the host staging buffer, one bundle per cache row
            per_layer = fixed + max(0, ffn_budget - n_layers * fixed) // (n_layers * per_row + row) * per_row
        if shared:  # one cache: its per-neuron state once, each layer its output (and input) bias and exact's ids
            bias = store.dtype.itemsize * n if input_bias_role(store) in store.ffn_roles[0] else 0
            layers_fixed = n_layers * (4 * store.hidden_size + bias + (0 if flash else 8 * n))
            cache_fixed, _ = NeuronCache.bytes_for(store, with_bias=bias > 0)
            if ffn_budget is not None and ffn_budget < layers_fixed + cache_fixed + per_row:
                raise too_small(layers_fixed + cache_fixed + per_row)
            cache = NeuronCache(
                store,
                0,
                n if ffn_budget is None else None,
                window,
                budget_bytes=None if ffn_budget is None else ffn_budget - layers_fixed,
                reader=reader,
                transfer=transfer,
            )
        elif per_layer is not None and per_layer < fixed + per_row:
            raise too_small(n_layers * (fixed + per_row))
        # (a predictor may choose its sets ahead its own way: bench_e2e's replayed sets)
        ahead = getattr(predictors, "predict_ahead", None) if flash else None
        modules = [
            ffn_class(
                store,
                i,
                predictor=partial(predictors.predict, i) if flash else None,
                threshold=float(predictors.thresholds[i]) if flash else 0.0,
                budget_bytes=None if shared else per_layer,
                capacity=None if shared or per_layer else n,
                window=window,
                reader=reader,
                stats=stats,
                transfer=transfer,
                lookahead=lookahead,
                ahead_predictor=None if ahead is None else partial(ahead, i),
                cache=cache,
            )
            for i in range(n_layers)
        ]
        held = sum(m.nbytes for m in modules) + transfer.nbytes + (cache.nbytes if shared else 0)
        return modules, held

    # naive / hybrid: a staging buffer for the streamed bundles, shared by every layer, plus resident bundles.
    def streaming_bytes(resident_rows: int) -> int:  # (a staged transfer's host staging: once more)
        staging_copies = 2 if transfer.staged else 1
        return n_layers * StreamingFFN.bytes_for(store, resident_rows) + staging_copies * (n - resident_rows) * row

    resident_rows = 0
    if mode == "hybrid":
        if ffn_budget is None:
            resident_rows = n // 2
        else:  # the most resident rows per layer that fit (streaming_bytes falls as they grow only if L = 1)
            low, high = 0, n
            while low < high:
                mid = (low + high + 1) // 2
                low, high = (mid, high) if streaming_bytes(mid) <= ffn_budget else (low, mid - 1)
            resident_rows = low
    if ffn_budget is not None and streaming_bytes(resident_rows) > ffn_budget:
        raise too_small(streaming_bytes(0))
    staging = transfer.empty((n - resident_rows, store.bundle_width), store.dtype)
    modules = [streaming_class(store, i, resident_rows, staging, reader, stats, transfer) for i in range(n_layers)]
    return modules, staging.nbytes + transfer.nbytes + sum(m.nbytes for m in modules)


def _cache_layout(cache_layout: str, store: FlashStore, predictors, transfer: Transfer, ffn_budget: int | None) -> str:
    """Flash / exact mode's cache layout, "per-layer" or "shared" (CACHE_LAYOUTS: "auto" decides), for an FFN
    budget of `ffn_budget` bytes (None: none; the per-layer rows "auto" compares with a set are estimated before
    the reader takes its share); predictors: flash mode's (None in exact mode: every neuron active)."""
    if cache_layout not in CACHE_LAYOUTS:
        raise ValueError(f"cache_layout must be one of {CACHE_LAYOUTS}, got {cache_layout!r}")
    if cache_layout == "shared" and transfer.staged:
        raise ValueError("cache_layout='shared' is for caches in host memory, not a device's staged cache")
    if cache_layout != "auto":
        return cache_layout
    density = 1.0 if predictors is None else getattr(predictors, "loaded_density", None)
    if ffn_budget is None or transfer.staged or density is None:
        return "per-layer"
    fixed, per_row = FlashFFN.bytes_for(store, every_neuron=predictors is None)
    layer_rows = (ffn_budget * (READER_BUFFER_SHARE - 1) // READER_BUFFER_SHARE // store.n_layers - fixed) // per_row
    return "shared" if layer_rows < density * store.n_neurons else "per-layer"


READER_BUFFER_SHARE = 64  # the reader's buffers may take 1/64 of what the budget leaves for the FFNs
# ... and half of it beside a shared cache: its sets are read whole every token in reads no longer than the bounce
# buffers (1/64 of a budget this small made them ~15 KB on the default model at 50%), and nothing is reused anyway.
SHARED_CACHE_READER_SHARE = 2


def _bounded_reader_options(
    store: FlashStore, budget_bytes: int | None, taken: int, share_of: int = READER_BUFFER_SHARE
) -> dict:
    """The engine's reader options under a budget: the reader's buffers (FlashReader.buffer_bound, charged to the
    budget) limited to 1 / `share_of` of the FFN budget. A dense store's reader has only bounce
    buffers; an Endor store's splits the share between them and its compressed staging, so both formats of a model
    charge the same and keep caches of the same capacity. Reads are capped at the bounce limit too (4 KiB to
    DEFAULT_MAX_READ): a longer read would get its own buffer beyond it. No budget: the reader's defaults."""
    if budget_bytes is None:
        return {}
    share = max(0, budget_bytes - taken) // share_of
    options = {"bounce_limit": share}
    if store.endor:  # staging_bound adds one row (bitmap + values) to staging_bytes
        one_row = (store.bundle_width + 7) // 8 + store.row_bytes
        options = {"bounce_limit": share // 2, "staging_bytes": max(1, share - share // 2 - one_row)}
    return {**options, "max_read": min(DEFAULT_MAX_READ, max(4096, options["bounce_limit"]))}


def ffn_stack(
    store: FlashStore,
    mode: str,
    budget_bytes: int | None,
    *,
    window: int = 5,
    predictors=None,
    threads: int = 32,
    resident_bytes: int = 0,
    device: str | torch.device = "cpu",
    transfer: Transfer | None = None,
    reader_options: dict | None = None,
    lookahead: str = "ahead",
    ffn_class: type[FlashFFN] = FlashFFN,
    streaming_class: type[StreamingFFN] = StreamingFFN,
    cache_layout: str = "auto",
) -> FlashRuntime:
    """Every FFN layer of `store` served by `mode` within `budget_bytes`, of which `resident_bytes` are already
    taken (a model's own tensors; 0 for a bare stack): runtime.modules[i](x) computes layer i of x [T, d]. The
    builder behind load_flash and patch_flash, and alone for FFN-only benchmarks at scales no checkpoint here has.
    device: where the FFN state lives ("cuda": the GPU; predictors are moved there); transfer: the one that places
    it (default make_transfer(device); tests pass a StagedTransfer on the CPU). lookahead: what a FlashFFN's
    forward does after its prefetch (LOOKAHEAD_MODES; the prefetch is the caller's, as load_flash's hooks).
    ffn_class / streaming_class: the flash and exact / the naive and hybrid modes' layer (a FlashFFN / StreamingFFN
    subclass: flashllm_ext.mlx's compute on mx.arrays over a flashllm_ext.mlx.MLXTransfer). cache_layout: flash and
    exact mode's (CACHE_LAYOUTS)."""
    if mode not in MODES or mode == "dense":
        raise ValueError(f"mode must be one of {MODES[1:]}, got {mode!r}")
    predictor_bytes = 0
    if mode == "flash":
        if predictors is None:
            raise ValueError(
                f"flash mode needs predictors: train them into the store (flashllm train-predictors "
                f"--store {store.path}) or pass predictors="
            )
        predictors.check_shape(store.n_layers, store.hidden_size, store.n_neurons, f"the store {store.path}")
        if getattr(predictors, "store_layout", "bundles") != "bundles":
            raise ValueError(
                f"{predictors.method} predictors read W_gate / W_up by input channel, a store layout "
                f"({predictors.store_layout}) that is not written: they are for evaluation only "
                "(bench/bench_predictor.py); use a neuron method (e.g. quant)"
            )
        predictor_bytes = predictors.memory_bytes
    transfer = transfer if transfer is not None else make_transfer(device)
    if mode == "flash":
        predictors.to(transfer.device)
    taken = resident_bytes + predictor_bytes
    layout = (
        None
        if mode not in ("flash", "exact")
        else _cache_layout(
            cache_layout,
            store,
            predictors if mode == "flash" else None,
            transfer,
            None if budget_bytes is None else budget_bytes - taken,
        )
    )
    share_of = SHARED_CACHE_READER_SHARE if layout == "shared" else READER_BUFFER_SHARE
    reader_options = {**_bounded_reader_options(store, budget_bytes, taken, share_of), **(reader_options or {})}
    reader, stats = FlashReader(store, threads=threads, **reader_options), FFNStats()
    # The reader's bounce buffers (one per thread, kept between calls) and an Endor store's compressed staging (one
    # read at a time): a fixed cost.
    fixed = resident_bytes + predictor_bytes + reader.buffer_bound()
    ffn_budget = None if budget_bytes is None else budget_bytes - fixed
    try:
        modules, ffn_bytes = _make_modules(
            store,
            mode,
            ffn_budget,
            window,
            predictors,
            reader,
            stats,
            budget_bytes,
            fixed,
            transfer,
            lookahead,
            ffn_class,
            streaming_class,
            layout,
        )
        ffn_bytes += reader.buffer_bound()
    except BaseException:
        reader.close()
        raise
    return FlashRuntime(
        store,
        mode,
        budget_bytes,
        resident_bytes,
        predictor_bytes,
        ffn_bytes,
        modules,
        stats,
        reader,
        predictors=predictors,
        cache_layout=layout,
    )


def model_bytes(model: nn.Module, store: FlashStore) -> int:
    """What the whole model weighs: its resident tensors, its FFN biases and every FFN bundle of the store."""
    biases = [p for name, p in _ffn_parameters(model) if name.endswith("bias")]
    return _resident_bytes(model) + tensor_bytes(biases) + store_ffn_bytes(store)


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
    a second predictor pass). BENCHMARKS.md measures both. cache_layout (flash / exact, CACHE_LAYOUTS): "per-layer"
    caches (the paper's), "shared" (one row matrix the layers use in turn), or "auto": shared when a per-layer cache
    would hold less than the predictors' loaded density of a layer's neurons, and no look-ahead is asked for;
    `model.flash.stats()["cache_layout"]` says which."""
    device = cuda_device(device)
    store = FlashStore(store_dir)
    dtype = dtype or store.dtype
    model = empty_model(store.config, dtype, store.path)
    predictors = predictors_for_mode(store, predictors, mode)
    assign_resident(model, store, dtype)
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
    leftover = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if leftover:
        raise ValueError(f"{store.path}: the store has no tensor for {leftover[:3]} ({len(leftover)} in all)")
    use_half_linears(model)  # the resident half-precision linears through flashllm::half_linear on the CPU
    return model.to(device).eval()


def _assign_dense_ffn(model: nn.Module, store: FlashStore, dtype: torch.dtype) -> None:
    """FFN weights of every layer from the store's bundles into the model's own Linear layers."""
    d = store.hidden_size
    with FlashReader(store) as reader:
        for i, (layer, modules) in enumerate(ffn_slots(model)):
            bundles = reader.read(i, torch.arange(store.n_neurons)).data.to(dtype)
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
