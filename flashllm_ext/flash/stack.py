"""The FFN stack: every FFN layer of a flash store served by one mode within a byte budget (ffn_stack), split between
the predictors, the caches or resident bundles, staging and the reader's buffers, and the FlashRuntime that holds it."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from flashllm_ext.flash.cache import NeuronCache, input_bias_role
from flashllm_ext.flash.ffn import FFNStats, FlashFFN
from flashllm_ext.flash.hot_cold import hot_count, hot_ids
from flashllm_ext.flash.placement import in_store_order
from flashllm_ext.flash.streaming import StreamingFFN
from flashllm_ext.flash.reader import DEFAULT_MAX_READ, FlashReader
from flashllm_ext.flash.store import FlashStore
from flashllm_ext.flash.transfer import Transfer, make_transfer
from flashllm_ext.io.buffers import ALIGNMENT, aligned_buffer
from flashllm_ext.runtime import Runtime, bound_heap_retention, deprecated_alias


MODES = ("dense", "naive", "hybrid", "flash", "exact")
# How flash / exact mode lays out its caches: one per layer (the paper's: hits across tokens), or one NeuronCache that
# every layer uses in turn (no hits; for budgets whose per-layer caches would hold less than a token's set, which
# they would then read and compute in many small parts), or per-layer caches that pin each layer's most frequently
# active neurons and keep a window cache for the rest ("hot-cold": flashllm_ext.flash.hot_cold splits the rows).
# "auto": shared exactly then, judged by the predictors' calibrated loaded density (per-layer when it is unknown).
CACHE_LAYOUTS = ("auto", "per-layer", "shared", "hot-cold")


def refuse_experts(store: FlashStore) -> None:
    """ValueError for a mixture-of-experts store: its experts run in expert caches, not in the neuron engine."""
    if store.experts is not None:
        raise ValueError(
            f"{store.path} is a mixture-of-experts store: its experts run through load_flash or the lean decoder "
            "(flashllm_ext.load_decoder, `flashllm run`), not through the neuron engine's FFNs"
        )


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
    cache_layout: str | None = None  # flash / exact: "per-layer", "shared" or "hot-cold" (CACHE_LAYOUTS); else None
    hooks: list = field(default_factory=list)  # the look-ahead hooks on the decoder layers (removable handles)
    expert_policy: str | None = None  # an MoE store's flash mode: its ExpertCache policy (flash.experts)

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
            "hot_fraction": self.hot_fraction,
            "reader_bounce_bytes": None if self.reader is None else self.reader.bounce_bytes(),
            **self._expert_stats(tokens),
        }

    def _expert_stats(self, tokens: int) -> dict:
        """An MoE store's: the cache policy, the experts needed and read (ahead, too) per token and layer, and the
        read-ahead's recall (the share of the needed experts it had guessed; None without read-ahead)."""
        layout, s = self.store.experts, self.counters
        if layout is None:
            return {}
        per = layout.size * max(tokens, 1) * self.store.n_layers
        ahead = s.prefetched or s.guessed
        return {
            "expert_policy": self.expert_policy,
            "experts_needed_per_layer": s.needed / per,
            "experts_read_per_layer": (s.inserted + s.prefetched) / per,
            "experts_read_ahead_per_layer": s.prefetched / per,
            "ahead_recall": s.guessed / s.needed if ahead and s.needed else None,
        }

    @property
    def hot_fraction(self) -> float:
        """The share of the FFN neurons pinned in the caches (the hot-cold layout; 0 otherwise)."""
        pinned = sum(m.cache.n_pinned for m in self.modules if isinstance(m, FlashFFN) and not m.shares_cache)
        return pinned / (self.store.n_layers * self.store.n_neurons)

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
        hot = _hot_sets(store, predictors if flash else None, per_layer, fixed, per_row, window, layout, reader)
        # (a predictor may choose its sets ahead its own way: bench_e2e_scale's replayed sets)
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
                hot_ids=hot[i],
            )
            for i in range(n_layers)
        ]
        held = sum(m.nbytes for m in modules) + transfer.nbytes + (cache.nbytes if shared else 0)
        return modules, held

    # naive / hybrid: a staging buffer for the streamed bundles, shared by every layer, plus resident bundles. In
    # host memory the streamed bundles of a dense or quantized store land in place (StreamingFFN landing): the
    # buffer then holds each layer's range widened to whole blocks, and its alignment.
    in_place = streaming_class is StreamingFFN and not transfer.staged and not store.endor

    def landing_bytes(resident_rows: int) -> int | None:
        if not in_place or resident_rows == n:
            return None
        ranges = [
            (store.layer_location(i).offset + resident_rows * row, (n - resident_rows) * row) for i in range(n_layers)
        ]
        if reader.range_unit > ALIGNMENT or any(reader.range_end(*r) > reader.file_bytes for r in ranges):
            return None
        landing = max(reader.range_bytes(start, size) for start, size in ranges)
        # The widening and the alignment (charged) cost at most a few blocks: on any real layer well under 1% of the
        # rows; on a toy store more, and its rows go through the reader's buffers as elsewhere.
        return landing if 100 * (landing + ALIGNMENT) <= 101 * (n - resident_rows) * row else None

    def streaming_bytes(resident_rows: int) -> int:  # (a staged transfer's host staging: once more)
        staging_copies = 2 if transfer.staged else 1
        landing = landing_bytes(resident_rows)
        staging = staging_copies * (n - resident_rows) * row if landing is None else landing + ALIGNMENT
        return n_layers * StreamingFFN.bytes_for(store, resident_rows) + staging

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
    landing_size = landing_bytes(resident_rows)
    if landing_size is not None:
        landing = aligned_buffer(landing_size)
        modules = [
            streaming_class(store, i, resident_rows, None, reader, stats, transfer, landing=landing)
            for i in range(n_layers)
        ]
        return modules, landing.untyped_storage().nbytes() + transfer.nbytes + sum(m.nbytes for m in modules)
    staging = transfer.empty((n - resident_rows, store.row_width), store.row_dtype)
    modules = [streaming_class(store, i, resident_rows, staging, reader, stats, transfer) for i in range(n_layers)]
    return modules, staging.nbytes + transfer.nbytes + sum(m.nbytes for m in modules)


def _hot_sets(
    store: FlashStore,
    predictors,
    per_layer: int | None,
    fixed: int,
    per_row: int,
    window: int,
    layout: str,
    reader: FlashReader,
) -> list[torch.Tensor | None]:
    """Per layer, the neurons its cache pins (the hot-cold layout; None: none), by the predictors' calibration
    frequencies (exact mode, no predictors: every neuron is always active, so the first ones), the split costed
    with `reader`'s coalescing plan."""
    n_layers, n = store.n_layers, store.n_neurons
    if layout != "hot-cold":
        return [None] * n_layers
    if per_layer is None:
        raise ValueError("cache_layout='hot-cold' splits a byte budget between hot and cold rows: give a budget")
    frequency = torch.ones(n_layers, n) if predictors is None else getattr(predictors, "frequency", None)
    if frequency is None or not frequency.any():
        raise ValueError(
            "cache_layout='hot-cold' pins neurons by their calibration frequency, which these predictors do not "
            "carry: build them again (flashllm train-predictors)"
        )
    frequency, rows = frequency.float().cpu(), min(n, (per_layer - fixed) // per_row)
    return [
        hot_ids(
            frequency[i],
            hot_count(frequency[i], rows, store.row_bytes, window, partial(reader.plan_layer, i), reader.threads),
        )
        for i in range(n_layers)
    ]


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


def bounded_reader_options(
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
    refuse_experts(store)
    if budget_bytes is not None:
        bound_heap_retention()
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
        predictors = in_store_order(predictors, store)
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
    reader_options = {**bounded_reader_options(store, budget_bytes, taken, share_of), **(reader_options or {})}
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
