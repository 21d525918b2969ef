"""Neuron placement on flash: the reads a token's set takes on a store placed by frequency or by co-activation against
the model's order, and decode speed of the hot-cold caches on placed stores against naive and hybrid.

Reads (deterministic, no I/O): the default predictors' sets on held-out text (the default model's own 30 x 1536
layers, and tiled onto Llama-2-7B FFN shapes, 11008 neurons of 24 KiB fp16 bundles: synthesized, the sets and their
skew are the 135M model's), each token's set minus the neurons the hot-cold caches would pin (the most frequent on
the calibration text, a `hot_fraction` of the layer), planned by the reader's own coalescing rule
(FlashReader.plan_rows: the saved disk profile's gap, else 64 KiB; reads under 32 KiB absorb the next row). Rows:
reads, MB read and MB requested per token, mean read KiB, and the ratios to the model's order at the same set. The
tiled layers take the tiled frequencies' order, and for co-activation each block in its small layer's chain.

Decode (--decode): bench_e2e's child on three stores of the default model (the model's order, placed by frequency,
by co-activation; the same predictors in each) at --budget inside a cgroup of its baseline + the budget: naive and
hybrid on the model's order, flash with hot-cold caches on each store, round-robin over --rounds, medians.

Floor (--floor): the least any flash cache of the default model can read at --budget, against what hybrid reads. Per
layer, the rows each mode's share of the budget holds (hybrid: the bundles it keeps resident; flash: the rows its
hot-cold caches get after the predictors, and, kinder to flash, hybrid's rows); per token, the neurons that any cache of
that many rows must read: the offline optimum (Belady's rule on the held-out sets, each token's set requested in turn:
keep the rows whose next use comes first; the cache starts with the rows first used soonest), a lower bound on every
policy's misses (window, hot-cold, LRU, any split). Those misses are read for real, on each placement's rows, at each
coalescing gap, interleaved per token with hybrid's read of its streamed bundles (one range a layer, as StreamingFFN
reads it); medians over --rounds of the per-token I/O time. A placed order is read on the model-order store's file at
the rows it gives each neuron (the same I/O: equal rows, permuted). Flash beats hybrid only if its I/O floor leaves room
for its predictor, which hybrid does not run.

    python -m bench.bench_placement [--json] [--tokens 256] [--decode] [--floor] [--budget 75%] [--rounds 3] [--smoke]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from bench.common import arg_parser, emit, median_rows

PLACEMENTS = ("model", "frequency", "coactivation")
HOT_FRACTIONS = (0.0, 0.25, 0.5)
SCALE = ("llama-2-7b (synthesized, tiled sets)", 4, 11008, 3 * 4096 * 2)  # name, layers measured, neurons, row bytes
SCALE_MODEL_LAYERS = 32
READ_COLUMNS = [
    "model",
    "placement",
    "hot_fraction",
    "reads_per_token",
    "mb_per_token",
    "requested_mb_per_token",
    "mean_read_kib",
    "reads_vs_model",
    "bytes_vs_model",
    "mean_read_vs_model",
]


def predictors_path(cache: Path) -> Path:
    """The default store of the end-to-end benchmarks (bench.e2e_common.default_store), whose predictors (the default
    recipe, trained once) carry the calibration statistics: trained into it again if they were built before the
    co-activation order was kept (and the sets they chose, cached beside it, dropped)."""
    from bench.e2e_common import default_store
    from flashllm_ext.predictor import load_predictors

    store = default_store(cache / "e2e")
    if not load_predictors(store).neuron_order.any():
        for sets in store.parent.glob(f"sets-{store.name}-*.pt"):  # (bench.traces.predicted_masks)
            sets.unlink()
        subprocess.run(
            [sys.executable, "-m", "flashllm_ext.cli", "train-predictors", "default", "--store", str(store)],
            check=True,
            stdout=sys.stderr,
        )  # stdout: --json rows
    return store


def layer_orders(predictors, placement: str) -> torch.Tensor:
    """int64 [L, n] of the default model's layers: the model's order, or the placement's (predictor.placement)."""
    from flashllm_ext.predictor import neuron_orders

    if placement == "model":
        return torch.arange(predictors.n_neurons).repeat(predictors.n_layers, 1)
    return neuron_orders(predictors, placement)


def tiled_orders(predictors, placement: str, n_layers: int, n_neurons: int) -> torch.Tensor:
    """int64 [n_layers, n_neurons]: the order of bench.traces' tiled layers (whole small layers side by side)."""
    from bench.traces import tile_layers
    from flashllm_ext.predictor import frequency_order

    if placement == "frequency":
        frequency = tile_layers(predictors.frequency[None], n_layers, n_neurons)[0]
        return torch.stack([frequency_order(f) for f in frequency])
    small = layer_orders(predictors, placement)
    blocks = -(-n_neurons // predictors.n_neurons)
    offsets = (torch.arange(blocks) * predictors.n_neurons)[None, :, None]
    # block b of large layer l holds small layer (l * blocks + b) % L0 (tile_layers): ids tiled the same way
    ids = tile_layers(small[None], n_layers, blocks * predictors.n_neurons)[0]
    orders = (ids.view(n_layers, blocks, -1) + offsets).view(n_layers, -1)
    return torch.stack([o[o < n_neurons] for o in orders])


def read_rows(
    sets: torch.Tensor,
    frequency: torch.Tensor,
    orders: dict[str, torch.Tensor],
    row_bytes: int,
    reader,
    model: str,
    model_layers: int,
) -> list[dict]:
    """Rows per placement and hot fraction for sets bool [T, L, n] (model order) of L of a model's `model_layers`
    layers, frequencies [L, n]: per-token figures scaled to the whole model."""
    from flashllm_ext.flash.hot_cold import hot_ids

    tokens, n_layers, n = sets.shape
    rows = []
    for hot_fraction in HOT_FRACTIONS:
        cold = sets.clone()
        for layer in range(n_layers):
            cold[:, layer, hot_ids(frequency[layer], int(hot_fraction * n))] = False
        base = None
        for placement, order in orders.items():
            row_of = torch.argsort(order, dim=1)  # the row each neuron sits in
            reads = read = requested = 0
            for layer in range(n_layers):
                for token in range(tokens):
                    ids = row_of[layer][cold[token, layer]].sort().values
                    if len(ids):
                        plan = reader.plan_rows(0, row_bytes, n, ids)
                        reads, read = reads + len(plan), read + int(plan[:, 1].sum())
                        requested += len(ids) * row_bytes
            per = tokens * n_layers / model_layers
            row = {
                "bench": "placement_reads",
                "model": model,
                "placement": placement,
                "hot_fraction": hot_fraction,
                "tokens": tokens,
                "row_bytes": row_bytes,
                "max_gap_kib": reader.max_gap / 1024,
                "reads_per_token": reads / per,
                "mb_per_token": read / per / 1e6,
                "requested_mb_per_token": requested / per / 1e6,
                "mean_read_kib": read / max(reads, 1) / 1024,
            }
            base = base or row
            row |= {
                "reads_vs_model": row["reads_per_token"] / base["reads_per_token"],
                "bytes_vs_model": row["mb_per_token"] / base["mb_per_token"],
                "mean_read_vs_model": row["mean_read_kib"] / base["mean_read_kib"],
            }
            rows.append(row)
    return rows


def reads_benchmark(cache: Path, n_tokens: int, scale_layers: int) -> list[dict]:
    from bench.traces import predicted_masks, tile_layers, tile_masks
    from flashllm_ext.flash.reader import FlashReader
    from flashllm_ext.flash.store import FlashStore
    from flashllm_ext.predictor import load_predictors

    path = predictors_path(cache)
    predictors = load_predictors(path)
    sets = predicted_masks(path, n_tokens)  # [T, 30, 1536], held-out text
    store = FlashStore(path)
    rows = []
    with FlashReader.for_file(store.bundles_path, threads=2) as reader:
        orders = {p: layer_orders(predictors, p) for p in PLACEMENTS}
        rows += read_rows(sets, predictors.frequency, orders, store.row_bytes, reader, "SmolLM2-135M", store.n_layers)
        name, _, n, row_bytes = SCALE
        big = tile_masks(sets, scale_layers, n)
        frequency = tile_layers(predictors.frequency[None], scale_layers, n)[0]
        orders = {p: tiled_orders(predictors, p, scale_layers, n) for p in PLACEMENTS}
        orders["model"] = torch.arange(n).repeat(scale_layers, 1)
        rows += read_rows(big, frequency, orders, row_bytes, reader, name, SCALE_MODEL_LAYERS)
    return rows


def placed_stores(cache: Path) -> dict[str, Path]:
    """The default model's fp16 store in each placement ("model": the end-to-end benchmarks' default store), each
    holding the same predictors; a placed store converted again when its order is not its predictors'."""
    from flashllm_ext.flash.convert import convert
    from flashllm_ext.flash.store import FlashStore
    from flashllm_ext.hub import fetch_default
    from flashllm_ext.predictor import DEFAULT_RECIPE, load_predictors, save_predictors_to_store

    model_order = predictors_path(cache)
    predictors = load_predictors(model_order)
    stores = {"model": model_order}
    for placement in PLACEMENTS[1:]:
        path = cache / "placement" / f"smollm2-135m-fp16-{placement}"
        order = layer_orders(predictors, placement)
        try:
            current = FlashStore(path).neuron_order
        except (OSError, ValueError):  # none yet, or an older format's
            current = None
        if current is None or not torch.equal(current, order):
            convert(fetch_default(), path, force=True, neuron_order=order)
        save_predictors_to_store(predictors, path, DEFAULT_RECIPE)
        stores[placement] = path
    return stores


def decode_benchmark(cache: Path, args) -> list[dict]:
    from bench.e2e_common import KEYS, measure_baseline, model_bytes_of, prompt_ids, run_configuration
    from flashllm_ext.flash.store import FlashStore
    from flashllm_ext.runtime import parse_budget

    stores = placed_stores(cache)
    total = model_bytes_of(stores["model"])
    budget = parse_budget(args.budget, total)
    baseline = measure_baseline("bench.bench_e2e", "cpu", stores["model"])
    ids, prompt_note = prompt_ids(args.prompt_tokens, FlashStore(stores["model"]).config["vocab_size"])
    jobs = [("naive", "model", {}), ("hybrid", "model", {})]
    jobs += [("flash", p, {"cache_layout": "hot-cold"}) for p in PLACEMENTS]
    rows = []
    for round_index in range(args.rounds):
        for mode, placement, options in jobs:
            config = {
                "model": "SmolLM2-135M-Instruct",
                "device": "cpu",
                "store": str(stores[placement]),
                "tokens": args.decode_tokens,
                "prompt_ids": ids,
                "timeout_s": 900,
                "offload_dir": str(cache / "e2e" / "accelerate-offload"),
                "hf_dir": None,
                "mode": mode,
                "budget_bytes": budget,
                "options": options,
            }
            row = run_configuration("bench.bench_e2e", config, baseline)
            row = {**{k: row.get(k) for k in KEYS}, **row}
            row.update(
                bench="placement_decode",
                placement=placement,
                budget_spec=args.budget,
                model_bytes_mb=total / 1e6,
                baseline_mb=baseline / 1e6,
                prompt_note=prompt_note,
                round=round_index,
                options=str(options) if options else None,
            )
            rows.append(row)
            emit([row], args.json, DECODE_COLUMNS)
    return rows


FLOOR_GAPS = (-1, 0, 64 << 10, 256 << 10)  # exact reads (one a neuron), adjacent rows merged, reads through gaps
FLOOR_WARMUP = 16  # held-out tokens the optimum runs through before the ones whose misses are read


def fewest_misses(sets: torch.Tensor, capacity: int) -> torch.Tensor:
    """bool [T, n]: per token of sets bool [T, n] (one layer's), the neurons that any cache of `capacity` rows must
    read (the offline optimum, see the module doc)."""
    tokens, n = sets.shape
    never = tokens  # the first use of a neuron no later set holds
    first_use = torch.full((tokens + 1, n), never, dtype=torch.int64)  # [t]: the first token >= t whose set holds it
    for t in range(tokens - 1, -1, -1):
        first_use[t] = torch.where(sets[t], t, first_use[t + 1])
    cached = torch.zeros(n, dtype=torch.bool)
    cached[first_use[0].topk(min(capacity, n), largest=False).indices] = True
    misses = torch.zeros_like(sets)
    for t in range(tokens):
        misses[t] = sets[t] & ~cached
        held = cached | sets[t]
        key = torch.where(held, first_use[t + 1], never + 1)  # what is not held now cannot be kept
        keep = key.topk(min(capacity, n), largest=False).indices
        cached = torch.zeros(n, dtype=torch.bool)
        cached[keep[key[keep] <= never]] = True
    return misses


def budget_rows(path: Path, budget: str) -> dict[str, list[int]]:
    """Rows a layer's FFN holds at `budget` of the store's model, per mode: hybrid's resident bundles, flash's
    hot-cold cache rows (what the predictors leave)."""
    from flashllm_ext.decoder import load_decoder
    from flashllm_ext.flash.store import FlashStore

    store = FlashStore(path)
    hybrid = load_decoder(path, budget, mode="hybrid", max_len=64)
    flash = load_decoder(path, budget, mode="flash", max_len=64, cache_layout="hot-cold")
    return {
        "hybrid's rows": [store.n_neurons - ffn.streamed_ids.numel() for ffn in hybrid.ffns],
        "flash's rows": [ffn.cache.capacity for ffn in flash.ffns],
    }


def floor_benchmark(cache: Path, args) -> list[dict]:
    """The I/O floor of flash against hybrid at --budget (module doc): a row per configuration, hybrid's read first,
    each with the median over rounds of hybrid's I/O time over its own (hybrid_io_ratio)."""
    from bench.bench_io import gap_reader, token_order
    from bench.traces import predicted_masks
    from flashllm_ext.flash.store import FlashStore
    from flashllm_ext.io.buffers import aligned_buffer
    from flashllm_ext.predictor import load_predictors

    path = predictors_path(cache)
    predictors, store = load_predictors(path), FlashStore(path)
    n, row_bytes = store.n_neurons, store.row_bytes
    sets = predicted_masks(path, FLOOR_WARMUP + args.floor_tokens)  # [T, L, n], held-out text
    timed = range(FLOOR_WARMUP, sets.shape[0])
    rows_of = budget_rows(path, args.budget)
    locations = [store.layer_location(layer) for layer in range(store.n_layers)]
    # configurations: (rows, placement, gap) -> per timed token, per layer: the rows to read, sorted
    configs: dict[tuple, list[list[torch.Tensor]]] = {}
    for rows_name, capacities in rows_of.items():
        misses = [fewest_misses(sets[:, layer], capacities[layer]) for layer in range(store.n_layers)]
        for placement in PLACEMENTS:
            row_of = torch.argsort(layer_orders(predictors, placement), dim=1)
            planned = [
                [row_of[layer][misses[layer][t]].sort().values for layer in range(store.n_layers)] for t in timed
            ]
            for gap in FLOOR_GAPS:
                configs[(rows_name, placement, gap)] = planned
    readers = {gap: gap_reader(store.bundles_path, gap) for gap in FLOOR_GAPS}
    resident = rows_of["hybrid's rows"]
    streamed = [(loc.offset + r * row_bytes, (n - r) * row_bytes) for loc, r in zip(locations, resident)]
    reader = readers[FLOOR_GAPS[-1]]
    landing = aligned_buffer(max(reader.range_bytes(*span) for span in streamed))
    out = aligned_buffer(n * row_bytes)
    names = [None, *configs]  # None: hybrid
    seconds = {name: [[0.0] * len(timed) for _ in range(args.rounds)] for name in names}
    counts = {name: [0, 0, 0] for name in names}  # bytes read, reads, rows requested over the timed tokens
    for rnd in tqdm(range(args.rounds), desc="floor rounds", disable=args.json):
        for i in range(len(timed)):
            for k in token_order(i + rnd, len(names)):
                name = names[k]
                for layer, loc in enumerate(locations):
                    if name is None:
                        stats = reader.read_range(*streamed[layer], landing)[1]
                        requested = n - resident[layer]
                    else:
                        ids = configs[name][i][layer]
                        stats = readers[name[2]].read_rows(
                            loc.offset, row_bytes, n, ids, out[: ids.numel() * row_bytes]
                        )
                        requested = ids.numel()
                    seconds[name][rnd][i] += stats.wall_s
                    if rnd == 0:
                        counts[name] = [
                            a + b for a, b in zip(counts[name], (stats.bytes_read, stats.n_reads, requested))
                        ]
    for r in readers.values():
        r.close()
    tokens = len(timed)
    per_round = {name: [sum(s) / tokens * 1e3 for s in seconds[name]] for name in names}
    hybrid_ms = per_round[None]
    rows = []
    for name in names:
        bytes_read, reads, requested = counts[name]
        ms = per_round[name]
        rows.append(
            {
                "bench": "placement_floor",
                "mode": "hybrid" if name is None else "flash floor",
                "rows_from": "hybrid's rows" if name is None else name[0],
                "rows_per_layer": statistics.median(resident if name is None else rows_of[name[0]]),
                "placement": "model" if name is None else name[1],
                "max_gap": None if name is None else name[2],
                "budget_spec": args.budget,
                "tokens": tokens,
                "rounds": args.rounds,
                "neurons_read_per_token": requested / tokens,
                "mb_per_token": bytes_read / tokens / 1e6,
                "reads_per_token": reads / tokens,
                "mean_read_kib": bytes_read / max(reads, 1) / 1024,
                "io_ms_per_token": statistics.median(ms),
                "io_ms_runs": [round(x, 1) for x in ms],
                "hybrid_io_ratio": statistics.median(h / f for h, f in zip(hybrid_ms, ms)),
            }
        )
    return rows


FLOOR_COLUMNS = [
    "mode",
    "rows_from",
    "rows_per_layer",
    "placement",
    "max_gap",
    "neurons_read_per_token",
    "mb_per_token",
    "reads_per_token",
    "mean_read_kib",
    "io_ms_per_token",
    "hybrid_io_ratio",
]


DECODE_COLUMNS = [
    "mode",
    "placement",
    "ms_per_token",
    "io_ms",
    "mem_ms",
    "compute_ms",
    "bytes_per_token",
    "reads_per_token",
    "hit_rate",
    "hot_fraction",
    "cgroup_limit_mb",
    "cgroup_peak_mb",
    "error",
]


def main(argv: list[str] | None = None) -> None:
    from flashllm_ext.io.paths import resolve_cache_dir

    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="held-out tokens whose sets are planned")
    parser.add_argument("--scale-layers", type=int, default=SCALE[1], help="7B-shaped layers planned")
    parser.add_argument("--decode", action="store_true", help="also time decoding on the placed stores")
    parser.add_argument("--floor", action="store_true", help="also read the fewest misses any flash cache can have")
    parser.add_argument("--floor-tokens", type=int, default=24, help="held-out tokens whose --floor misses are read")
    parser.add_argument("--budget", default="75%", help="--decode's and --floor's DRAM budget (of the model's bytes)")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.set_defaults(rounds=3)
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.scale_layers, args.decode_tokens, args.prompt_tokens, args.rounds = 4, 1, 2, 4, 1
        args.floor, args.floor_tokens = True, 2
    cache = resolve_cache_dir()
    rows = reads_benchmark(cache, args.tokens, args.scale_layers)
    emit(rows, args.json, READ_COLUMNS)
    if args.floor:
        emit(floor_benchmark(cache, args), args.json, FLOOR_COLUMNS)
    if args.decode:
        rows = decode_benchmark(cache, args)
        medians = median_rows(rows, ("mode", "placement"), "placement_decode_median")
        if not args.json:
            print(f"\nmedians over {args.rounds} round(s):")
        emit(medians, args.json, DECODE_COLUMNS)


if __name__ == "__main__":
    main()
