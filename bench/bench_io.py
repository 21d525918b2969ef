"""Flash I/O benchmarks ('LLM in a flash' Figure 2b and Table 2, I/O only).

fig2b   random-read throughput vs read size and threads: FlashReader (O_DIRECT, no coalescing) paired with fio
        (randread, same block size, numjobs = threads, direct=1) on the same test file, interleaved, alternating
        which goes first; medians of the repeats, ratio = median of the paired ratios. Plot: bench/results/fig2b.png.
table2  bytes / reads / I/O ms per token on a synthesized store with OPT-6.7B FFN shapes (d=4096, ffn=16384,
        fp16, --layers layers), driven by the default model's activation masks on held-out text, thresholded to
        --sparsity and tiled onto the larger layers (bench/traces.py).

fig2b pairs each reader run with a fio run and compares the throughputs each reports, so it keeps its own paired
loop instead of bench/common.py's timer. The page cache is dropped at start (root) and every read is O_DIRECT.

    python bench/bench_io.py [--json] [--only fig2b|table2] [--sizes-kib 4,16,...] [--threads 1,8,32]
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
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import emit  # noqa: E402
from flashllm_ext import store  # noqa: E402
from flashllm_ext.convert import synthesize  # noqa: E402
from flashllm_ext.paths import resolve_cache_dir  # noqa: E402
from traces import default_model_mask_source  # noqa: E402
from flashllm_ext.disk import make_test_file, random_read_throughput  # noqa: E402
from flashllm_ext.reader import FlashReader, has_io_uring  # noqa: E402

# What the table (not --json) shows of each result row.
TABLE_COLUMNS = {
    "fig2b": ["engine", "threads", "read_kib", "reader_mbps", "fio_mbps", "ratio"],
    "table2": ["config", "bytes_per_token", "bytes_vs_analytic", "reads_per_token", "mean_read_kib", "io_ms_per_token",
               "mbps"],
}
RESULTS = Path(__file__).resolve().parent / "results"
CACHE = Path(os.environ.get("FLASHLLM_BENCH_DIR") or resolve_cache_dir() / "bench")


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def ensure_file(path: Path, size: int) -> Path:
    if not path.is_file() or path.stat().st_size != size:
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {size >> 20} MiB test file {path}", file=sys.stderr)
        make_test_file(path, size)
    return path


# ----------------------------------------------------------------------------------------------- fig2b
def fio_mbps(path: Path, read_bytes: int, threads: int, seconds: float, engine: str) -> float:
    """fio randread throughput in MB/s; engine 'threads' = psync with numjobs=threads, 'io_uring' = one job with
    iodepth=threads, matching the two FlashReader engines."""
    parallel = ["--ioengine=psync", f"--numjobs={threads}"] if engine == "threads" else \
        ["--ioengine=io_uring", f"--iodepth={threads}", "--numjobs=1"]
    cmd = ["fio", "--name=fig2b", f"--filename={path}", "--rw=randread", f"--bs={read_bytes}", "--direct=1",
           "--thread", "--group_reporting", "--norandommap", "--randrepeat=0", f"--runtime={int(seconds * 1000)}ms",
           "--time_based", f"--size={path.stat().st_size}", "--output-format=json", *parallel]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    report = json.loads(out[out.index("{"):])  # fio may print notes before the JSON
    return report["jobs"][0]["read"]["bw_bytes"] / 1e6


def reader_mbps(reader: FlashReader, file_size: int, read_bytes: int, seconds: float, n_reads: int,
                out: torch.Tensor) -> tuple[float, int]:
    """Throughput of one batch of random reads, and the batch size that would take about `seconds`."""
    stats = random_read_throughput(reader, file_size, read_bytes, n_reads, out=out)
    assert stats.n_reads == n_reads and stats.bytes_read == n_reads * read_bytes, stats
    per_read = stats.wall_s / stats.n_reads
    next_n = int(min(max(seconds / per_read, 4 * reader.threads), file_size // read_bytes))
    return stats.mbps, next_n


def fig2b(args: argparse.Namespace, report: Callable[[dict], None]) -> list[dict]:
    path = ensure_file(CACHE / "fig2b.bin", args.file_gib << 30)
    size = path.stat().st_size
    engines = ["threads"] + (["io_uring"] if has_io_uring() and args.io_uring else [])
    rows = []
    # Page-aligned, so whole-block reads land in it without a bounce buffer, as fio's do.
    backing = torch.zeros((args.out_mib << 20) + 4096, dtype=torch.uint8)
    skip = -backing.data_ptr() % 4096
    out = backing[skip:skip + (args.out_mib << 20)]
    for engine in engines:
        for threads in args.threads:
            for kib in args.sizes_kib:
                read_bytes = kib << 10
                reader = FlashReader.for_file(path, threads=threads, min_read=0, max_gap=-1,
                                              max_read=max(read_bytes, 4096), engine=engine)
                # fio never copies what it reads, so the reader's destination is touched before timing (first-touch
                # page faults are the caller's allocation cost, not I/O). The pilot batch sizes the timed ones.
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
                row = {"bench": "fig2b", "read_kib": kib, "threads": threads, "engine": engine,
                       "reader_mbps": round(statistics.median(ours), 1), "fio_mbps": round(statistics.median(theirs), 1),
                       "ratio": round(statistics.median(a / b for a, b in zip(ours, theirs)), 3),
                       "reader_runs": [round(x, 1) for x in ours], "fio_runs": [round(x, 1) for x in theirs]}
                report(row)
                rows.append(row)
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
    for (engine, threads) in sorted({(r["engine"], r["threads"]) for r in rows}):
        cell = sorted((r for r in rows if r["engine"] == engine and r["threads"] == threads), key=lambda r: r["read_kib"])
        x = [r["read_kib"] for r in cell]
        line, = ax.plot(x, [r["reader_mbps"] for r in cell], marker="o", label=f"FlashReader {engine} T={threads}")
        ax.plot(x, [r["fio_mbps"] for r in cell], ls="--", marker="x", color=line.get_color(),
                label=f"fio T={threads}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("read size (KiB)")
    ax.set_ylabel("random read throughput (MB/s)")
    ax.set_title("Random direct reads vs read size and threads (cf. LLM in a flash, Fig. 2b)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    RESULTS.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(RESULTS / "fig2b.png", dpi=120)


# ----------------------------------------------------------------------------------------------- table2
def _split_layout(path: Path, n_layers: int, n_neurons: int, half_row: int) -> Path:
    """The unbundled layout: per layer, up rows [ffn, d] then down columns stored as rows [ffn, d] (down^T)."""
    return ensure_file(path, n_layers * 2 * n_neurons * half_row)


def table2(args: argparse.Namespace, report: Callable[[dict], None],
           mask_source: Callable[[int, int, int], torch.Tensor] | None = None) -> list[dict]:
    """mask_source(n_tokens, n_layers, n_neurons) -> bool [tokens, layers, neurons]: the active neurons per token.

    Default: the default model's real masks at --sparsity, tiled onto the OPT-6.7B layers (bench/traces.py).
    """
    mask_source = mask_source or default_model_mask_source(args.sparsity)
    d, ffn, item = 4096, 16384, 2
    row = 2 * d * item  # OPT bundle: up column + down row, fp16
    half = row // 2
    bundled_dir = CACHE / f"opt67b_ffn_{args.layers}l"
    if not (bundled_dir / store.BUNDLES_FILE).is_file():
        print(f"synthesizing {args.layers}-layer OPT-6.7B-shaped store in {bundled_dir}", file=sys.stderr)
        shutil.rmtree(bundled_dir, ignore_errors=True)
        synthesize(bundled_dir, args.layers, d, ffn)
    fs = store.FlashStore(bundled_dir)
    split = _split_layout(CACHE / f"opt67b_ffn_split_{args.layers}l.bin", args.layers, ffn, half)
    masks = mask_source(args.tokens, args.layers, ffn)
    window = args.window
    new_masks = masks.clone()
    for t in range(masks.shape[0]):
        # Neurons active in any of the previous `window` tokens are still in DRAM (sliding-window cache).
        if t:
            new_masks[t] &= ~masks[max(0, t - window):t].any(0)
    density = masks.float().mean().item()

    split_base = lambda layer: layer * 2 * ffn * half  # noqa: E731
    store_base = lambda layer: fs.layer_location(layer).offset  # noqa: E731
    both_halves = lambda m: torch.cat([m.nonzero().flatten(), m.nonzero().flatten() + ffn])  # noqa: E731
    new_ids = lambda t, l: new_masks[t, l].nonzero().flatten()  # noqa: E731
    per_neuron = lambda ms: lambda t, layer: int(ms[t, layer].sum()) * row  # noqa: E731
    chunk = 1 << 20
    n_chunks = 2 * ffn * half // chunk
    no_coalescing = {"min_read": 0, "max_gap": -1}
    # name, reader, ids(t, layer), row bytes, layer base offset, rows per layer, analytic bytes(t, layer)
    configs = [
        ("naive (whole FFN)", FlashReader.for_file(split, threads=args.max_threads, max_read=chunk, **no_coalescing),
         lambda t, l: torch.arange(n_chunks), chunk, split_base, n_chunks, lambda t, l: 2 * ffn * half),
        ("predicted", FlashReader.for_file(split, threads=args.base_threads, **no_coalescing),
         lambda t, l: both_halves(masks[t, l]), half, split_base, 2 * ffn, per_neuron(masks)),
        ("+ window", FlashReader.for_file(split, threads=args.base_threads, **no_coalescing),
         lambda t, l: both_halves(new_masks[t, l]), half, split_base, 2 * ffn, per_neuron(new_masks)),
        ("+ bundling", FlashReader(fs, threads=args.base_threads, **no_coalescing),
         new_ids, row, store_base, ffn, per_neuron(new_masks)),
        (f"+ coalescing, {args.max_threads} threads", FlashReader(fs, threads=args.max_threads, max_gap=args.max_gap),
         new_ids, row, store_base, ffn, per_neuron(new_masks)),
    ]
    totals = {c[0]: {"bytes_read": 0, "reads": 0, "wall": 0.0, "analytic": 0, "tokens": 0} for c in configs}
    # Tokens outer, configurations inner: the disk's drifts hit every row alike. The first `window` tokens only
    # fill the window and are skipped by every row; the naive row reads 256 MiB per layer, so it runs on fewer.
    for t in range(window, args.tokens):
        for name, reader, ids_of, row_bytes, base_of, n_rows, analytic in configs:
            if name.startswith("naive") and t >= window + args.naive_tokens:
                continue
            total = totals[name]
            for layer in range(args.layers):
                ids = ids_of(t, layer)
                out = torch.empty(ids.numel() * row_bytes, dtype=torch.uint8)
                s = reader.read_rows(base_of(layer), row_bytes, n_rows, ids, out)
                total["bytes_read"] += s.bytes_read
                total["reads"] += s.n_reads
                total["wall"] += s.wall_s
                total["analytic"] += analytic(t, layer)
            total["tokens"] += 1
    rows = []
    for name, reader, *_ in configs:
        total = totals[name]
        n = total["tokens"]
        result = {"bench": "table2", "config": name, "bytes_per_token": total["bytes_read"] / n,
                  "analytic_bytes_per_token": total["analytic"] / n,
                  "bytes_vs_analytic": round(total["bytes_read"] / max(1, total["analytic"]), 4),
                  "reads_per_token": total["reads"] / n,
                  "mean_read_kib": round(total["bytes_read"] / max(1, total["reads"]) / 1024, 1),
                  "io_ms_per_token": round(total["wall"] / n * 1e3, 2),
                  "mbps": round(total["bytes_read"] / max(total["wall"], 1e-9) / 1e6, 1),
                  "threads": reader.threads, "max_gap": reader.max_gap, "tokens": n, "layers": args.layers,
                  "mask_density": round(density, 4), "window": window,
                  "mask_source": getattr(mask_source, "__name__", str(mask_source))}
        report(result)
        rows.append(result)
        reader.close()
    return rows


# ----------------------------------------------------------------------------------------------- main
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="one JSON object per result line")
    p.add_argument("--only", choices=("fig2b", "table2"))
    p.add_argument("--sizes-kib", type=_ints, default=_ints("4,16,32,64,128,256,1024"))
    p.add_argument("--threads", type=_ints, default=_ints("1,8,32"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seconds", type=float, default=1.0, help="target duration of one timed run")
    p.add_argument("--file-gib", type=int, default=4, help="fig2b test file size")
    p.add_argument("--out-mib", type=int, default=1024, help="fig2b: largest batch the reader fills per run")
    p.add_argument("--io-uring", action="store_true", help="also the io_uring engine (vs fio's io_uring)")
    p.add_argument("--layers", type=int, default=4, help="table2: OPT-6.7B-shaped layers (256 MiB each, x2 files)")
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--sparsity", type=float, default=0.95,
                   help="table2: per-layer threshold target of the default model's masks (0.95 ~ OPT-6.7B's ReLU)")
    p.add_argument("--naive-tokens", type=int, default=2)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--base-threads", type=int, default=8)
    p.add_argument("--max-threads", type=int, default=32)
    p.add_argument("--max-gap", type=int, default=None, help="table2 coalescing gap (default: calibrated profile)")
    args = p.parse_args(argv)
    if shutil.which("fio") is None and args.only != "table2":
        sys.exit("fio is not installed (make deps installs it)")
    dropped = drop_page_cache()
    print(f"# page cache dropped: {dropped}; all reads O_DIRECT; machine: {os.cpu_count()} cores", file=sys.stderr)

    for name, run in (("fig2b", fig2b), ("table2", table2)):
        if args.only not in (None, name):
            continue
        rows: list[dict] = []

        def report(row: dict) -> None:
            rows.append(row)
            if args.json:  # each result as soon as it is measured: a full run takes a long time
                emit([row], True)

        run(args, report)
        if not args.json:
            emit(rows, False, TABLE_COLUMNS[name])

if __name__ == "__main__":
    main()
