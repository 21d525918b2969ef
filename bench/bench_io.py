"""Flash I/O benchmarks ('LLM in a flash' Figure 2b and Table 2, I/O only).

fig2b   random-read throughput vs read size and threads: FlashReader (O_DIRECT, no coalescing) paired with fio
        (randread, same block size, numjobs = threads, direct=1) on the same test file, interleaved, alternating
        which goes first; medians of the repeats, ratio = median of the paired ratios. Plot:
        bench/results/bench_io_fig2b.png.
table2  Flash-to-DRAM bytes / reads / I/O ms per token of each configuration of the paper's Table 2 (naive, then
        predictor-driven, + window, + bundling, + 32 threads, + coalescing, each step driven once by the default
        model's trained predictors' sets and once by the true sets, "oracle") on a flash store (--store: the default
        model's, or one with OPT-6.7B's FFN shapes), over --layers of the model's layers. The sets are those of
        --tokens held-out tokens from --documents documents (bench/traces.py). Per token the configurations run in
        an order rotated by one, each on its own copy of the file(s) it reads (cached under the bench cache dir), so
        none reads blocks another just read; the I/O time of a token is the sum of its layers' read calls; rows
        report the median over tokens, and the deterministic counts (bytes, reads, mean read size).
gaps    what the reads of a token's whole set cost at each coalescing gap (--gaps: exact reads, one per neuron, up
        to a read through 1 MiB of unrequested rows) on a store (--store; a 7B-scale one in practice), the true sets
        at --sparsity (--tokens tokens, --layers layers), each round paired with fio's sequential rate (1 MiB reads)
        and its random rate at the bundle size on the same file. The `gaps_bound` row is the floor this sets on a
        flash token against a system that re-reads the whole model every token (llama.cpp under a memory limit below
        its file): the store's bytes at fio's sequential rate over the fastest gap's reads scaled to all the
        model's layers, per round, median (an upper bound on that ratio: no compute, no predictor, no cache hits
        beyond a token's own set).

fig2b pairs each reader run with a fio run and compares the throughputs each reports, so it keeps its own paired
loop instead of bench/common.py's timer. The page cache is dropped at start (root) and every read is O_DIRECT.

    python -m bench.bench_io [--json] [--only fig2b|table2|gaps] [--sizes-kib 4,16,...] [--threads 1,8,32]
                             [--store default|opt-6.7b|DIR] [--layers N] [--tokens 256] [--documents 8]
                             [--gaps -1,24576,...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from bench.common import drop_page_cache, emit
from bench.traces import default_model_mask_source, predicted_mask_source, predictor_training, trained_predictors
from flashllm_ext.flash import store
from flashllm_ext.flash.convert import synthesize
from flashllm_ext.io.paths import resolve_cache_dir
from flashllm_ext.flash.calibrate import make_test_file, random_read_throughput
from flashllm_ext.flash.reader import DEFAULT_MIN_READ, DEFAULT_THREADS, FlashReader, has_io_uring

# What the table (not --json) shows of each result row.
TABLE_COLUMNS = {
    "fig2b": ["engine", "threads", "read_kib", "reader_mbps", "fio_mbps", "ratio"],
    "table2": [
        "config",
        "sets",
        "threads",
        "max_gap",
        "bytes_per_token",
        "bytes_vs_analytic",
        "reads_per_token",
        "mean_read_kib",
        "io_ms_per_token",
        "speedup_vs_naive",
        "mbps",
        "tokens",
    ],
    "gaps": [
        "kind",
        "max_gap",
        "bytes_per_token",
        "reads_per_token",
        "mean_read_kib",
        "io_ms_per_token",
        "mbps",
        "bound",
    ],
}
RESULTS = Path(__file__).resolve().parent / "results"
CACHE = Path(os.environ.get("FLASHLLM_BENCH_DIR") or resolve_cache_dir() / "bench_io")


def ensure_file(path: Path, size: int) -> Path:
    if not path.is_file() or path.stat().st_size != size:
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {size >> 20} MiB test file {path}", file=sys.stderr)
        make_test_file(path, size)
    return path


# ----------------------------------------------------------------------------------------------- fig2b
def fio_read(path: Path, rw: str, read_bytes: int, parallel: list[str], seconds: float) -> dict:
    """fio's report of `rw` reads (randread or read) of `read_bytes` over the whole file, direct, for `seconds`:
    its read section (bw_bytes, iops, ...)."""
    cmd = [
        "fio",
        "--name=bench_io",
        f"--filename={path}",
        "--readonly",
        f"--rw={rw}",
        f"--bs={read_bytes}",
        "--direct=1",
        "--thread",
        "--group_reporting",
        "--norandommap",
        "--randrepeat=0",
        f"--runtime={max(1, int(seconds * 1000))}ms",
        "--time_based",
        f"--size={path.stat().st_size // read_bytes * read_bytes}",
        "--output-format=json",
        *parallel,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out[out.index("{") :])["jobs"][0]["read"]  # fio may print notes before the JSON


def fio_mbps(path: Path, read_bytes: int, threads: int, seconds: float, engine: str) -> float:
    """fio randread throughput in MB/s; engine 'threads' = psync with numjobs=threads, 'io_uring' = one job with
    iodepth=threads, matching the two FlashReader engines."""
    parallel = (
        ["--ioengine=psync", f"--numjobs={threads}"]
        if engine == "threads"
        else ["--ioengine=io_uring", f"--iodepth={threads}", "--numjobs=1"]
    )
    return fio_read(path, "randread", read_bytes, parallel, seconds)["bw_bytes"] / 1e6


def reader_mbps(
    reader: FlashReader, file_size: int, read_bytes: int, seconds: float, n_reads: int, out: torch.Tensor
) -> tuple[float, int]:
    """Throughput of one batch of random reads, and the batch size that would take about `seconds`."""
    stats = random_read_throughput(reader, file_size, read_bytes, n_reads, out=out)
    assert stats.n_reads == n_reads and stats.bytes_read == n_reads * read_bytes, stats
    per_read = stats.wall_s / stats.n_reads
    next_n = int(min(max(seconds / per_read, 4 * reader.threads), file_size // read_bytes))
    return stats.mbps, next_n


def fig2b(args: argparse.Namespace, report: Callable[[dict], None]) -> list[dict]:
    path = ensure_file(CACHE / "fig2b.bin", args.file_mib << 20)
    size = path.stat().st_size
    engines = ["threads"] + (["io_uring"] if has_io_uring() and args.io_uring else [])
    rows = []
    out = aligned_buffer(args.out_mib << 20)  # as fio's: no bounce buffer, no first-touch faults timed
    for engine in engines:
        for threads in args.threads:
            for kib in args.sizes_kib:
                read_bytes = kib << 10
                reader = FlashReader.for_file(
                    path, threads=threads, min_read=0, max_gap=-1, max_read=max(read_bytes, 4096), engine=engine
                )
                # The pilot batch sizes the timed ones.
                _, n = reader_mbps(reader, size, read_bytes, args.seconds, max(8 * threads, 64), out)
                n = min(n, out.numel() // read_bytes)
                ours, theirs = [], []
                for rep in range(args.repeats):
                    order = (0, 1) if rep % 2 == 0 else (1, 0)  # alternate who goes first
                    for who in order:
                        if who == 0:
                            mbps, n = reader_mbps(reader, size, read_bytes, args.seconds, n, out)
                            n = min(n, out.numel() // read_bytes)
                            ours.append(mbps)
                        else:
                            theirs.append(fio_mbps(path, read_bytes, threads, args.seconds, engine))
                row = {
                    "bench": "fig2b",
                    "read_kib": kib,
                    "threads": threads,
                    "engine": engine,
                    "reader_mbps": round(statistics.median(ours), 1),
                    "fio_mbps": round(statistics.median(theirs), 1),
                    "ratio": round(statistics.median(a / b for a, b in zip(ours, theirs)), 3),
                    "reader_runs": [round(x, 1) for x in ours],
                    "fio_runs": [round(x, 1) for x in theirs],
                }
                report(row)
                rows.append(row)
    if not args.smoke:  # a smoke run measures nothing worth a figure
        plot_fig2b(rows)
    return rows


def plot_fig2b(rows: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for engine, threads in sorted({(r["engine"], r["threads"]) for r in rows}):
        cell = sorted(
            (r for r in rows if r["engine"] == engine and r["threads"] == threads), key=lambda r: r["read_kib"]
        )
        x = [r["read_kib"] for r in cell]
        (line,) = ax.plot(x, [r["reader_mbps"] for r in cell], marker="o", label=f"FlashReader {engine} T={threads}")
        ax.plot(x, [r["fio_mbps"] for r in cell], ls="--", marker="x", color=line.get_color(), label=f"fio T={threads}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("read size (KiB)")
    ax.set_ylabel("random read throughput (MB/s)")
    ax.set_title("Random direct reads vs read size and threads (cf. LLM in a flash, Fig. 2b)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(RESULTS / "bench_io_fig2b.png", dpi=120)


# ----------------------------------------------------------------------------------------------- table2
@dataclass(frozen=True)
class Table2Config:
    """One row of Table 2: which neurons are read (sets: "all" = the whole FFN, "predictor" = the trained
    predictors' sets, "oracle" = the true sets), and how: only neurons not in the last `window` tokens' sets
    (window), whole bundles in one read each (bundled) or up / gate / down as separate reads from a split layout,
    `threads` reads in flight, adjacent and nearby neurons merged into one read (coalescing)."""

    name: str
    sets: str
    window: bool = False
    bundled: bool = False
    threads: int = 8
    coalescing: bool = False


def table2_configs(base_threads: int, max_threads: int) -> list[Table2Config]:
    """The rows: naive, then the paper's chain of techniques one at a time, each step twice: driven by the trained
    predictors' sets and by the true sets (labelled oracle, an upper bound)."""
    steps = [
        ("predictor-driven", {}),
        ("+ window", {"window": True}),
        ("+ bundling", {"window": True, "bundled": True}),
        (f"+ {max_threads} threads", {"window": True, "bundled": True, "threads": max_threads}),
        ("+ coalescing", {"window": True, "bundled": True, "threads": max_threads, "coalescing": True}),
    ]
    configs = [Table2Config("naive (whole FFN)", "all", threads=max_threads)]
    for name, how in steps:
        configs += [Table2Config(name, sets, **{"threads": base_threads, **how}) for sets in ("predictor", "oracle")]
    return configs


def gap_reader(path: Path, gap: int, threads: int = DEFAULT_THREADS) -> FlashReader:
    """A reader of `path` that reads through gaps up to `gap` bytes; -1: exact reads, one a row (no gap read through
    and no short read widened to the minimum read size)."""
    return FlashReader.for_file(path, threads=threads, max_gap=gap, min_read=0 if gap < 0 else DEFAULT_MIN_READ)


def token_order(token: int, n_configs: int) -> list[int]:
    """The configurations' order for one token: rotated by one each token, so each runs first (after the disk's
    idle time, with the others' reads behind it) equally often."""
    return [(token + i) % n_configs for i in range(n_configs)]


def aligned_buffer(nbytes: int, align: int = 4096) -> torch.Tensor:
    """uint8 [nbytes] starting on an `align`-byte boundary, every page written once: whole aligned reads land in it
    without a bounce buffer, and first-touch page faults (the caller's allocation cost) are not timed as I/O."""
    backing = torch.empty(nbytes + align, dtype=torch.uint8)
    skip = -backing.data_ptr() % align
    out = backing[skip : skip + nbytes]  # a view: keeps `backing` alive
    out.fill_(1)
    return out


def own_copy(path: Path, size: int, make: Callable[[Path], None]) -> Path:
    """`path`, made once by make(tmp) unless it exists with `size` bytes (copies are cached across runs)."""
    if not path.is_file() or path.stat().st_size != size:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        print(f"writing {size >> 20} MiB {path}", file=sys.stderr)
        make(tmp)
        tmp.replace(path)
    return path


# --store names of synthesized stores: (d, neurons, the model's layers, layers written by default, description)
SYNTHESIZED_STORES = {
    "opt-6.7b": (4096, 16384, 32, 4, "store with OPT-6.7B FFN shapes"),
    "smoke": (64, 512, 2, 2, "store at smoke shapes (d 64, 512 neurons)"),
}


def table2_store(spec: str, layers: int | None) -> tuple[store.FlashStore, int, str]:
    """(the store, the model's layer count, a description) for --store: "default" = the default model's fp16 store
    (e2e_common.default_store), "opt-6.7b" = a synthesized store with OPT-6.7B's FFN shapes (d=4096, 16384 neurons,
    fp16; `layers` of its 32), else a store directory."""
    if spec == "default":
        from bench.e2e_common import DEFAULT_MODEL, default_store

        fs = store.FlashStore(default_store(resolve_cache_dir() / "e2e", train_predictors=False))
        return fs, fs.n_layers, f"{DEFAULT_MODEL} fp16 store"
    if spec in SYNTHESIZED_STORES:
        d, neurons, model_layers, default_layers, description = SYNTHESIZED_STORES[spec]
        n = layers or default_layers
        path = CACHE / f"{spec.replace('.', '').replace('-', '')}_ffn_{n}l"
        if not (path / store.BUNDLES_FILE).is_file():
            print(f"synthesizing a {n}-layer {description} in {path}", file=sys.stderr)
            shutil.rmtree(path, ignore_errors=True)
            synthesize(path, n, d, neurons)
        return store.FlashStore(path), model_layers, f"{description} (sets tiled)"
    fs = store.FlashStore(spec)
    return fs, fs.n_layers, f"store {spec}"


def _chunk_rows(total_rows: int, row_bytes: int, max_bytes: int = 1 << 20) -> int:
    """The most rows, a divisor of total_rows, whose bytes fit in max_bytes: the naive row reads whole layers in
    equal chunks of about 1 MiB (the fastest size in Figure 2b here)."""
    return max(
        r for r in range(1, total_rows + 1) if total_rows % r == 0 and r * row_bytes <= max(max_bytes, row_bytes)
    )


def table2(
    args: argparse.Namespace,
    report: Callable[[dict], None],
    set_sources: dict[str, Callable[[int, int, int], torch.Tensor]] | None = None,
    fs: store.FlashStore | None = None,
    model_layers: int | None = None,
) -> list[dict]:
    """Flash-to-DRAM I/O per token of the configurations of table2_configs on `fs` (default: --store).

    set_sources: "predictor" and "oracle" -> (n_tokens, n_layers, n_neurons) -> bool [tokens, layers, neurons], the
    active neurons per token (default: the default model's --predictor predictors' and true sets at --sparsity on
    --documents pieces of held-out text, bench/traces.py). Each configuration reads its own copy of the file(s) it
    reads (the bundled store file, or the same bytes in the split layout: per layer up rows, gate rows (GLU), down
    columns stored as rows), so no configuration finds blocks another just read in a device cache; all reads are
    O_DIRECT, into preallocated page-aligned touched buffers.
    """
    description = f"store {fs.path}" if fs is not None else None
    if fs is None:
        fs, model_layers, description = table2_store(args.store, args.layers)
    model_layers = model_layers or fs.n_layers
    layers = min(args.layers or fs.n_layers, fs.n_layers)
    if set_sources is None:
        cache = resolve_cache_dir() / "e2e"
        set_sources = {
            "oracle": default_model_mask_source(args.sparsity, args.documents),
            "predictor": predicted_mask_source(
                trained_predictors(cache, predictor_training(args.predictor, args.sparsity)), args.documents
            ),
        }
    window, n = args.window, fs.n_neurons
    pieces = -(-(args.tokens + window) // args.documents)
    n_tokens = pieces * args.documents  # the first `window` only fill the window: every row skips them
    sets = {name: source(n_tokens, layers, n) for name, source in set_sources.items()}
    new = {}
    for name, masks in sets.items():
        new[name] = masks.clone()
        for t in range(1, n_tokens):  # neurons of the previous `window` tokens' sets are still in DRAM
            new[name][t] &= ~masks[max(0, t - window) : t].any(0)

    parts = 3 if fs.glu else 2  # the split layout: up, gate (GLU), down as separate rows of row_bytes / parts
    part = fs.row_bytes // parts
    layer_bytes = n * fs.row_bytes
    chunk_rows = _chunk_rows(parts * n, part)
    copies: dict[str, int] = {}
    configs = table2_configs(args.base_threads, args.max_threads)
    tag = fs.path.name  # a bundled copy is the whole store file; a split one holds the first `layers` layers
    plans = []
    for index, config in enumerate(configs):
        if config.bundled:
            size = Path(fs.bundles_path).stat().st_size
            path = own_copy(
                CACHE / f"{tag}-{index:02d}-bundled.bin", size, lambda tmp: shutil.copyfile(fs.bundles_path, tmp)
            )
            base_of = lambda layer: fs.layer_location(layer).offset  # noqa: E731
        else:
            path = own_copy(
                CACHE / f"{tag}-{layers}l-{index:02d}-split.bin",
                layers * layer_bytes,
                lambda tmp: make_test_file(tmp, layers * layer_bytes),
            )
            base_of = lambda layer: layer * layer_bytes  # noqa: E731
        copies[str(path)] = path.stat().st_size
        coalescing = {"max_gap": args.max_gap} if config.coalescing else {"min_read": 0, "max_gap": -1}
        reader = FlashReader.for_file(
            path, threads=config.threads, max_read=max(chunk_rows * part, 1 << 20), **coalescing
        )
        masks = None if config.sets == "all" else (new if config.window else sets)[config.sets]
        if masks is None:
            row_bytes, n_rows, largest = chunk_rows * part, parts * n // chunk_rows, parts * n // chunk_rows
        elif config.bundled:
            row_bytes, n_rows, largest = fs.row_bytes, n, int(masks.sum(-1).max())
        else:
            row_bytes, n_rows, largest = part, parts * n, parts * int(masks.sum(-1).max())
        plans.append(
            {
                "config": config,
                "reader": reader,
                "masks": masks,
                "base_of": base_of,
                "row_bytes": row_bytes,
                "n_rows": n_rows,
                "out": aligned_buffer(largest * row_bytes),
                "path": path,
                "tokens_ms": [],
                "bytes_read": 0,
                "reads": 0,
                "analytic": 0,
            }
        )
    print(f"# {len(copies)} copies, {sum(copies.values()) / 2**30:.2f} GiB under {CACHE}", file=sys.stderr)
    drop_page_cache()  # the copies were just written through it (every read below is O_DIRECT anyway)

    def ids_of(plan: dict, t: int, layer: int) -> torch.Tensor:
        if plan["masks"] is None:
            return torch.arange(plan["n_rows"])
        active = plan["masks"][t, layer].nonzero().flatten()
        if plan["config"].bundled:
            return active
        return torch.cat([active + p * n for p in range(parts)])  # up_i, gate_i, down_i: rows i, n + i, 2n + i

    naive_end = window + args.naive_tokens
    for t in tqdm(range(window, n_tokens), desc="table2 tokens", disable=args.json):
        for index in token_order(t, len(plans)):
            plan = plans[index]
            if plan["masks"] is None and t >= naive_end:  # 0.1-1 GB per token: a few tokens suffice
                continue
            wall = 0.0
            for layer in range(layers):
                ids = ids_of(plan, t, layer)
                stats = plan["reader"].read_rows(
                    plan["base_of"](layer),
                    plan["row_bytes"],
                    plan["n_rows"],
                    ids,
                    plan["out"][: ids.numel() * plan["row_bytes"]],
                )
                wall += stats.wall_s
                plan["bytes_read"] += stats.bytes_read
                plan["reads"] += stats.n_reads
                plan["analytic"] += (
                    layer_bytes if plan["masks"] is None else int(plan["masks"][t, layer].sum()) * fs.row_bytes
                )
            plan["tokens_ms"].append(wall * 1e3)
    unit = f"per token over {layers} of the model's {model_layers} FFN layers"
    naive_ms = statistics.median(plans[0]["tokens_ms"])
    rows = []
    for plan in plans:
        config, reader, done = plan["config"], plan["reader"], len(plan["tokens_ms"])
        median_ms = statistics.median(plan["tokens_ms"])
        measured = slice(window, window + done)
        density = 1.0 if plan["masks"] is None else sets[config.sets][measured].float().mean().item()
        read_density = 1.0 if plan["masks"] is None else plan["masks"][measured].float().mean().item()
        # What the window costs in DRAM (not timed here): the neurons of the current and previous `window` sets.
        held = (
            None
            if not config.window
            else statistics.fmean(
                sets[config.sets][t - window : t + 1].any(0).float().mean().item() for t in range(window, window + done)
            )
        )
        row = {
            "bench": "table2",
            "config": config.name,
            "sets": config.sets,
            "layout": "bundled" if config.bundled else "split",
            "window": window if config.window else 0,
            "threads": reader.threads,
            "max_gap": reader.max_gap,
            "min_read": reader.min_read,
            "bytes_per_token": plan["bytes_read"] / done,
            "analytic_bytes_per_token": plan["analytic"] / done,
            "bytes_vs_analytic": round(plan["bytes_read"] / max(1, plan["analytic"]), 4),
            "reads_per_token": plan["reads"] / done,
            "mean_read_kib": round(plan["bytes_read"] / max(1, plan["reads"]) / 1024, 2),
            "io_ms_per_token": round(median_ms, 2),
            "io_ms_mean": round(statistics.fmean(plan["tokens_ms"]), 2),
            "speedup_vs_naive": round(naive_ms / median_ms, 2),
            "mbps": round(plan["bytes_read"] / max(sum(plan["tokens_ms"]) / 1e3, 1e-9) / 1e6, 1),
            "set_density": round(density, 4),
            "read_density": round(read_density, 4),
            "window_density": None if held is None else round(held, 4),
            "tokens": done,
            "layers": layers,
            "model_layers": model_layers,
            "unit": unit,
            "documents": args.documents,
            "store": description,
            "file": str(plan["path"]),
            "set_source": "everything"
            if config.sets == "all"
            else getattr(set_sources[config.sets], "__name__", str(set_sources[config.sets])),
        }
        report(row)
        rows.append(row)
        reader.close()
    if args.remove_copies:
        for path in copies:
            os.unlink(path)
    return rows


# ----------------------------------------------------------------------------------------------- gaps
SEQUENTIAL_READ = 1 << 20  # fio's sequential rate: 1 MiB reads, the fastest size of Figure 2b here
SEQUENTIAL_DEPTH = 8


def gaps(
    args: argparse.Namespace,
    report: Callable[[dict], None],
    set_source: Callable[[int, int, int], torch.Tensor] | None = None,
    fs: store.FlashStore | None = None,
    model_layers: int | None = None,
) -> list[dict]:
    """I/O of a token's whole set at each coalescing gap of args.gaps (-1: exact reads), with fio's sequential and
    bundle-size random rates of the store's file in every round, and the bound they set (module docstring).

    set_source: (n_tokens, n_layers, n_neurons) -> bool [tokens, layers, neurons] (default: the default model's true
    sets at --sparsity, tiled). Every round reads the same --tokens tokens' sets over the first --layers layers at
    every gap, the gaps in an order rotated by one each round; the rows give medians over the rounds."""
    description = f"store {fs.path}" if fs is not None else None
    if fs is None:
        fs, model_layers, description = table2_store(args.store, args.layers)
    model_layers = model_layers or fs.n_layers
    layers = min(args.layers or fs.n_layers, fs.n_layers)
    set_source = set_source or default_model_mask_source(args.sparsity, args.documents)
    sets = set_source(args.tokens, layers, fs.n_neurons)
    path = Path(fs.bundles_path)
    readers = [gap_reader(path, gap, args.max_threads) for gap in args.gaps]
    out = aligned_buffer(int(sets.sum(-1).max()) * fs.row_bytes)
    locations = [fs.layer_location(layer) for layer in range(layers)]
    per_gap = [{"ms": [], "bytes": 0, "reads": 0} for _ in readers]
    # fio's read sizes: 1 MiB (or the whole file, at smoke sizes) and one bundle widened to whole 4 KiB blocks (what a
    # direct read of one bundle reads).
    sequential_bytes = min(SEQUENTIAL_READ, path.stat().st_size // 4096 * 4096)
    random_bytes = -(-fs.row_bytes // 4096) * 4096
    sequential, random = [], []
    for rnd in tqdm(range(args.repeats), desc="gaps rounds", disable=args.json):
        sequential.append(
            fio_read(
                path, "read", sequential_bytes, [f"--iodepth={SEQUENTIAL_DEPTH}", "--ioengine=io_uring"], args.seconds
            )
        )
        random.append(
            fio_read(
                path, "randread", random_bytes, [f"--iodepth={args.max_threads}", "--ioengine=io_uring"], args.seconds
            )
        )
        for index in token_order(rnd, len(readers)):
            wall, totals = 0.0, per_gap[index]
            for t in range(args.tokens):
                for layer, loc in enumerate(locations):
                    ids = sets[t, layer].nonzero().flatten()
                    stats = readers[index].read_rows(
                        loc.offset, loc.row_bytes, loc.n_neurons, ids, out[: ids.numel() * loc.row_bytes]
                    )
                    wall += stats.wall_s
                    if rnd == 0:  # the counts are the same every round
                        totals["bytes"] += stats.bytes_read
                        totals["reads"] += stats.n_reads
            totals["ms"].append(wall * 1e3 / args.tokens)
    common = {
        "bench": "gaps",
        "store": description,
        "layers": layers,
        "model_layers": model_layers,
        "rounds": args.repeats,
        "set_density": round(sets.float().mean().item(), 4),
        "set_source": getattr(set_source, "__name__", str(set_source)),
        "unit": f"per token over {layers} of the model's {model_layers} FFN layers",
    }
    rows = []
    for reads, kind in (
        (sequential, f"fio read {sequential_bytes} B"),
        (random, f"fio randread {random_bytes} B"),
    ):
        rows.append(
            {
                **common,
                "kind": kind,
                "mbps": round(statistics.median(r["bw_bytes"] for r in reads) / 1e6, 1),
                "iops": round(statistics.median(r["iops"] for r in reads)),
                "mbps_runs": [round(r["bw_bytes"] / 1e6, 1) for r in reads],
            }
        )
    for reader, totals in zip(readers, per_gap):
        rows.append(
            {
                **common,
                "kind": "FlashReader, exact reads" if reader.max_gap < 0 else "FlashReader, coalesced",
                "max_gap": reader.max_gap,
                "min_read": reader.min_read,
                "threads": reader.threads,
                "bytes_per_token": totals["bytes"] / args.tokens,
                "reads_per_token": totals["reads"] / args.tokens,
                "mean_read_kib": round(totals["bytes"] / max(1, totals["reads"]) / 1024, 1),
                "io_ms_per_token": round(statistics.median(totals["ms"]), 1),
                "io_ms_runs": [round(ms, 1) for ms in totals["ms"]],
                "mbps": round(totals["bytes"] / args.tokens / statistics.median(totals["ms"]) / 1e3, 1),
            }
        )
        reader.close()
    # Per round: the whole store re-read at that round's sequential rate over the fastest gap's reads of all layers.
    resident = Path(fs.resident_path)
    model_bytes = path.stat().st_size + (resident.stat().st_size if resident.is_file() else 0)
    scale = model_layers / layers
    bounds = [
        model_bytes / sequential[r]["bw_bytes"] * 1e3 / (min(totals["ms"][r] for totals in per_gap) * scale)
        for r in range(args.repeats)
    ]
    rows.append(
        {
            **common,
            "kind": "bound: store re-read / fastest gap",
            "model_bytes": model_bytes,
            "bound": round(statistics.median(bounds), 2),
            "bound_runs": [round(b, 2) for b in bounds],
        }
    )
    for row in rows:
        report(row)
    return rows


# ----------------------------------------------------------------------------------------------- main
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="one JSON object per result line")
    p.add_argument("--only", choices=("fig2b", "table2", "gaps"))
    p.add_argument("--sizes-kib", type=_ints, default=_ints("4,16,32,64,128,256,1024"))
    p.add_argument("--threads", type=_ints, default=_ints("1,8,32"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=1.0, help="target duration of one timed run")
    p.add_argument("--file-mib", type=int, default=4096, help="fig2b test file size")
    p.add_argument("--out-mib", type=int, default=1024, help="fig2b: largest batch the reader fills per run")
    p.add_argument("--io-uring", action="store_true", help="also the io_uring engine (vs fio's io_uring)")
    p.add_argument(
        "--store",
        default="default",
        help="table2: 'default' (the default model's fp16 store), 'opt-6.7b' (synthesized, OPT-6.7B FFN "
        "shapes, 4 layers unless --layers) or a store directory",
    )
    p.add_argument("--layers", type=int, help="table2: the first N layers of the store (default: all)")
    p.add_argument(
        "--tokens",
        type=int,
        default=256,
        help="table2: timed tokens (at least; rounded up to whole pieces of --documents)",
    )
    p.add_argument("--documents", type=int, default=8, help="table2: held-out documents the tokens come from")
    p.add_argument(
        "--sparsity",
        type=float,
        default=0.97,
        help="table2: threshold sparsity of the true sets and the one the predictors were trained for "
        "(0.97: the OPT-like operating point, what the paper measured for OPT)",
    )
    p.add_argument(
        "--predictor",
        choices=("lowrank", "quant"),
        default="quant",
        help="table2: the predictors of the predictor rows (bench/traces.py predictor_training)",
    )
    p.add_argument("--naive-tokens", type=int, default=8)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--base-threads", type=int, default=8)
    p.add_argument("--max-threads", type=int, default=32)
    p.add_argument("--max-gap", type=int, default=None, help="table2 coalescing gap (default: calibrated profile)")
    p.add_argument(
        "--gaps",
        type=_ints,
        default=_ints("-1,24576,65536,131072,262144,1048576"),
        help="gaps: the coalescing gaps in bytes (-1: exact reads, one per neuron)",
    )
    p.add_argument(
        "--remove-copies",
        action="store_true",
        help="table2: delete the per-configuration file copies at the end (default: kept for the next run)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a 16 MiB file, two read sizes, a synthesized store at smoke shapes, one repeat: proves the script runs",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.file_mib, args.out_mib, args.sizes_kib, args.threads = 16, 16, [4, 64], [1, 8]
        args.repeats, args.seconds, args.store, args.tokens, args.documents = 1, 0.05, "smoke", 4, 1
        args.naive_tokens, args.base_threads, args.max_threads = 1, 2, 4
    if shutil.which("fio") is None and args.only != "table2":
        sys.exit("fio is not installed (make deps installs it)")
    drop_page_cache()
    print(
        f"# page cache dropped: {os.geteuid() == 0} (root); all reads O_DIRECT; machine: {os.cpu_count()} cores",
        file=sys.stderr,
    )

    for name, run in (("fig2b", fig2b), ("table2", table2), ("gaps", gaps)):
        if args.only not in (None, name):
            continue
        rows: list[dict] = []

        def report(row: dict) -> None:
            rows.append(row)
            if args.json:  # each result as soon as it is measured: a full run takes a long time
                emit([row], True)

        run(args, report)
        if not args.json:
            if name == "table2" and rows:
                print(f"Table 2: flash-to-DRAM I/O {rows[0]['unit']} ({rows[0]['store']}); io_ms_per_token: median")
            emit(rows, False, TABLE_COLUMNS[name])


if __name__ == "__main__":
    main()
