"""Sparse FFN and neuron-cache benchmarks ('LLM in a flash' §3.3 / Figure 4a).

bench "ffn": flashllm_ext.ops.sparse_ffn over the cached active rows vs the dense FFN (torch linear layers, same
dtype) on the layer shapes of OPT-6.7B (d=4096, 16384 neurons, ReLU) and Llama-2-7B (d=4096, 11008, SwiGLU) at
90/95/97% sparsity, T=1 and 4 tokens; and vs the memory-bandwidth bound: the active rows' bytes divided by the
read bandwidth of a 512 MiB streaming sum measured interleaved in the same run. The sparse side rotates over
enough copies of the cache matrix (one per "layer") to span >= 256 MiB, so its rows come from DRAM as in a real
decode, not from the 32 MiB L3. Cached rows are active rows: their biases are set so every ReLU activation is
positive (with random data half would be zero and their down rows skipped, flattering the kernel). On a GPU,
sparse_graph_ms / dense_graph_ms time the same calls replayed from a CUDA graph: the GPU's own time, where back-to-back
calls of a few-microsecond kernel time the host's python, dispatch and launches (bound_ratio_graph: the kernel's).

bench "qffn": flashllm_ext.ops.quantized_sparse_ffn over rows of GGUF blocks (q8_0+q8_0, q4_0+q8_0, q4_0+q4_0) on
Llama-2-7B's layer shape (d=4096, 11008 neurons, SwiGLU) at loaded densities 0.05 and 0.45, T=1 and 4; against
its byte bound (the rows' quantized bytes / the streaming-sum bandwidth, interleaved) and against sparse_ffn over
the same neurons' float16 bundles. Rows rotate over copies spanning >= 256 MiB as in bench "ffn"; on a GPU the same
calls are also replayed from a CUDA graph (quantized_graph_ms, bound_ratio_graph).

bench "cache": NeuronCache memory management per token over a real activation trace: SmolLM2-135M (the default
model) on held-out text, |act(gate)*up| thresholded per layer to 95% sparsity (calibrated on the calibration
text), whole layers' masks side by side cut to 16384 neurons (bench/traces.py) so each token drives an
OPT-6.7B-shaped layer (synthetic random weights in a flash store on disk, read with O_DIRECT). Per window
k = 1..8: neurons inserted and evicted per token, memory-management time (planning + swap-delete + bookkeeping,
StepStats.mem_s), I/O time, and the sparse_ffn compute time on the cache after each step. Plots: Figure 4a
(aggregated neuron usage vs tokens) and per-token load vs window, bench/results/bench_ffn_neuron_usage.png and
bench_ffn_load_vs_window.png.

    python -m bench.bench_ffn [--json] [--rounds N] [--only ffn|qffn|cache] [--quick] [--dtype fp16|bf16|fp32]
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import arg_parser, cycling, device_name, emit, stream_probe, time_interleaved
from bench.traces import default_model_masks, tile_masks

from flashllm_ext import ops
from flashllm_ext.ops.blocks import BundleFormat
from flashllm_ext.flash.cache import NeuronCache
from flashllm_ext.flash.convert import synthesize
from flashllm_ext.flash.store import DTYPES, FlashStore

SHAPES = {"opt-6.7b": (4096, 16384, False, "relu"), "llama-2-7b": (4096, 11008, True, "silu")}
SMOKE_SHAPES = {
    "opt-6.7b (smoke: d 64, 512 neurons)": (64, 512, False, "relu"),
    "llama-2-7b (smoke: d 64, 352 neurons)": (64, 352, True, "silu"),
}
RESULTS = Path(__file__).resolve().parent / "results"
ROTATE_BYTES = 256 << 20


# ------------------------------------------------------------------------------------------------ bench ffn
GRAPH_CALLS = 20  # calls captured in one CUDA graph (graph_replays): its replay's time / GRAPH_CALLS per call


def graph_replays(fn, calls: int = GRAPH_CALLS):
    """A candidate that replays `calls` calls of fn captured in one CUDA graph: the GPU's time per call without the
    host's (python, dispatch, launches), which back-to-back calls of a ~10 us kernel measure instead."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the allocator's blocks for fn's outputs exist before the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def add_device_variants(candidates: dict, names: tuple[str, ...], on_gpu: bool) -> str | None:
    """Adds the device's variants of candidates `names` to time beside them: on the CPU `<first>_1t`, the first on one
    OpenMP thread (immune to the barrier waits of a shared machine); on a GPU `<name>_graph` for each (graph_replays).
    Returns why a graph could not be captured, or None (the row says why; its other columns still stand)."""
    if not on_gpu:
        fn = candidates[names[0]]

        def one_thread():
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            fn()
            torch.set_num_threads(threads)

        candidates[f"{names[0]}_1t"] = one_thread
        return None
    try:
        for name in names:
            candidates[f"{name}_graph"] = graph_replays(candidates[name])
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    return None


def device_variant_columns(
    times: dict, names: tuple[str, ...], bound: float, on_gpu: bool, graph_error: str | None
) -> dict:
    """The row's columns of add_device_variants' timings: `<first>_1t_ms` and bound_ratio_1t on the CPU;
    `<name>_graph_ms` per call and the first's bound_ratio_graph on a GPU (or graph_error)."""
    first = names[0]
    if not on_gpu:
        return {f"{first}_1t_ms": times[f"{first}_1t"] * 1e3, "bound_ratio_1t": times[f"{first}_1t"] / bound}
    if graph_error is not None:
        return {"graph_error": graph_error}
    columns = {f"{name}_graph_ms": times[f"{name}_graph"] / GRAPH_CALLS * 1e3 for name in names}
    columns["bound_ratio_graph"] = times[f"{first}_graph"] / GRAPH_CALLS / bound
    return columns


def dense_ffn(x, w_up, w_down, w_gate, act):
    if w_gate is None:
        return F.linear(F.relu(F.linear(x, w_up)), w_down)
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def bench_ffn(
    dtype_name: str,
    rounds: int,
    quick: bool,
    device: str = "cpu",
    smoke: bool = False,
    on_row: Callable[[dict], object] = lambda row: None,
) -> list[dict]:
    """smoke: SMOKE_SHAPES, as quick, two copies of the rows (timed, not measured: the rows prove the script).
    on_row: called with each row as soon as it is measured."""
    dtype = DTYPES[dtype_name]
    on_gpu = device == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    quick = quick or smoke
    probe_bytes, stream = stream_probe(device, smoke)
    g = torch.Generator().manual_seed(0)
    rows = []
    for shape_name, (d, n, glu, act) in (SMOKE_SHAPES if smoke else SHAPES).items():
        width = (3 if glu else 2) * d
        # Dense weights of one layer (>= 268 MB: never cache-resident), nn.Linear layout.
        w_up = (torch.randn(n, d, generator=g) / d**0.5).to(device, dtype)
        w_gate = (torch.randn(n, d, generator=g) / d**0.5).to(device, dtype) if glu else None
        w_down = (torch.randn(d, n, generator=g) / n**0.5).to(device, dtype)
        for sparsity in (0.97,) if quick else (0.90, 0.95, 0.97):
            used = int(round((1 - sparsity) * n))
            row_bytes = width * dtype.itemsize
            copies = 2 if smoke else max(2, -(-ROTATE_BYTES // (used * row_bytes)))
            active = torch.randperm(n, generator=g)[:used].to(device)
            base = torch.cat([w_up[active]] + ([w_gate[active]] if glu else []) + [w_down[:, active].t()], 1)
            mats = [base.contiguous()] + [torch.empty_like(base).copy_(base) for _ in range(copies - 1)]
            bias = None if glu else torch.full((used,), 4.0, dtype=dtype, device=device)  # every cached ReLU row active
            for n_tok in (1,) if quick else (1, 4):
                x = torch.randn(n_tok, d, generator=g).to(device, dtype)
                sparse = cycling(
                    lambda i: ops.sparse_ffn(x, mats[i], num_used=used, activation=act, glu=glu, bias=bias), copies
                )

                # The same sum, checked against dense math restricted to the active neurons.
                want = dense_ffn(
                    x.float(),
                    w_up[active].float(),
                    w_down[:, active].float(),
                    None if w_gate is None else w_gate[active].float(),
                    act,
                )
                if bias is not None:
                    want = F.linear(
                        F.relu(F.linear(x.float(), w_up[active].float(), bias.float())), w_down[:, active].float()
                    )
                got = sparse().float()
                assert torch.allclose(got, want, rtol=3e-2, atol=3e-2 * want.abs().max().item()), "sparse_ffn wrong"
                candidates = {
                    "sparse": sparse,
                    "dense": lambda: dense_ffn(x, w_up, w_down, w_gate, act),
                    "stream": stream,
                }
                graph_error = add_device_variants(candidates, ("sparse", "dense"), on_gpu)
                times = time_interleaved(candidates, rounds=rounds, sync=sync)
                bandwidth = probe_bytes / times["stream"]
                bound = used * row_bytes / bandwidth
                rows.append(
                    {
                        "bench": "ffn",
                        "shape": shape_name,
                        "glu": glu,
                        "dtype": dtype_name,
                        "sparsity": sparsity,
                        "tokens": n_tok,
                        "rows": used,
                        "sparse_ms": times["sparse"] * 1e3,
                        "dense_ms": times["dense"] * 1e3,
                        "speedup": times["dense"] / times["sparse"],
                        "bound_ms": bound * 1e3,
                        "bound_ratio": times["sparse"] / bound,
                        "stream_gbps": bandwidth / 1e9,
                        "device": device_name(device),
                    }
                )
                rows[-1].update(device_variant_columns(times, ("sparse", "dense"), bound, on_gpu, graph_error))
                on_row(rows[-1])
            mats = None  # the copies leave device memory before the next shape's are made
    return rows


# ------------------------------------------------------------------------------------------------ bench qffn
QUANTIZED_FORMATS = ("q8_0+q8_0", "q4_0+q8_0", "q4_0+q4_0")


def bench_quantized_ffn(
    rounds: int,
    quick: bool,
    device: str = "cpu",
    smoke: bool = False,
    on_row: Callable[[dict], object] = lambda row: None,
) -> list[dict]:
    """quantized_sparse_ffn on `device` against its byte bound and against sparse_ffn on float16 bundles (see the
    module doc); on a GPU also replayed from a CUDA graph (as bench "ffn"). smoke: SMOKE_SHAPES' Llama shape, two
    copies."""
    on_gpu = device == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    probe_bytes, stream = stream_probe(device, smoke)
    shape_name, (d, n, glu, act) = list((SMOKE_SHAPES if smoke else SHAPES).items())[1]
    g = torch.Generator().manual_seed(0)
    rows = []
    for density in (0.05,) if quick or smoke else (0.05, 0.45):
        used = int(round(density * n))
        bundles = torch.randn(used, 3 * d, generator=g) / d**0.5  # [up | gate | down] of the loaded neurons
        half_copies = 2 if smoke else max(2, -(-ROTATE_BYTES // (used * 3 * d * 2)))
        halves = [bundles.to(device, torch.float16) for _ in range(half_copies)]
        for name in QUANTIZED_FORMATS[:1] if smoke else QUANTIZED_FORMATS:
            layout = BundleFormat.parse(name)
            quantized = layout.quantize(bundles[:, :d], bundles[:, 2 * d :].t(), bundles[:, d : 2 * d])
            row_bytes = quantized.shape[1]
            copies = 2 if smoke else max(2, -(-ROTATE_BYTES // (used * row_bytes)))
            mats = [quantized.to(device) for _ in range(copies)]
            for n_tok in (1,) if quick or smoke else (1, 4):
                x = torch.randn(n_tok, d, generator=g).half()
                x_dev = x.to(device)
                qffn = cycling(
                    lambda i: ops.quantized_sparse_ffn(
                        x_dev, mats[i], num_used=used, activation=act, glu=glu, bundle_format=name
                    ),
                    copies,
                )
                want = ops.quantized_sparse_ffn_reference(x, quantized, used, None, act, glu, name)
                got = qffn().float().cpu()
                assert torch.allclose(got, want.float(), rtol=1e-2, atol=1e-2 * want.abs().max().item()), "wrong"
                candidates = {
                    "quantized": qffn,
                    "fp16": cycling(
                        lambda i: ops.sparse_ffn(x_dev, halves[i], num_used=used, activation=act, glu=glu), half_copies
                    ),
                    "stream": stream,
                }
                graph_error = add_device_variants(candidates, ("quantized",), on_gpu)
                times = time_interleaved(candidates, rounds=rounds, sync=sync)
                bound = used * row_bytes / (probe_bytes / times["stream"])
                rows.append(
                    {
                        "bench": "qffn",
                        "shape": shape_name,
                        "bundle_format": name,
                        "density": density,
                        "tokens": n_tok,
                        "rows": used,
                        "row_bytes": row_bytes,
                        "fp16_row_bytes": 3 * d * 2,
                        "quantized_ms": times["quantized"] * 1e3,
                        "fp16_ms": times["fp16"] * 1e3,
                        "speedup_vs_fp16": times["fp16"] / times["quantized"],
                        "bound_ms": bound * 1e3,
                        "bound_ratio": times["quantized"] / bound,
                        "stream_gbps": probe_bytes / times["stream"] / 1e9,
                        "device": device_name(device),
                    }
                )
                rows[-1].update(device_variant_columns(times, ("quantized",), bound, on_gpu, graph_error))
                on_row(rows[-1])
            mats = None
    return rows


# ------------------------------------------------------------------------------------------------ bench cache
def bench_cache(
    rounds: int,
    quick: bool,
    dtype_name: str,
    store_dir: Path,
    plots: bool,
    on_row: Callable[[dict], object] = lambda row: None,
) -> list[dict]:
    d, n = SHAPES["opt-6.7b"][0], SHAPES["opt-6.7b"][1]
    n_tokens = 64 if quick else 256
    target = 0.95
    trace = tile_masks(default_model_masks(n_tokens, target), 1, n)[:, 0]
    info = {
        "model": "SmolLM2-135M",
        "tokens": n_tokens,
        "target_sparsity": target,
        "achieved_sparsity": 1 - trace.float().mean().item(),
    }
    trace_ids = [row.nonzero().flatten() for row in trace]
    if not (store_dir / "bundles.safetensors").is_file():
        synthesize(store_dir, n_layers=1, hidden_size=d, n_neurons=n, glu=False, dtype=dtype_name)
    store = FlashStore(store_dir)
    x = torch.randn(1, d, generator=torch.Generator().manual_seed(0)).to(store.dtype)
    rows, loads = [], {}
    for window in (1, 4) if quick else range(1, 9):
        per_round = []
        for _ in range(max(1, rounds // 2)):
            cache = NeuronCache(store, 0, capacity=n, window=window)
            inserted = evicted = 0
            mem = io = compute = 0.0
            load = []
            for ids in trace_ids:
                s = cache.step(ids)
                t0 = time.perf_counter()
                ops.sparse_ffn(x, cache.matrix, num_used=cache.num_used, activation="relu", glu=False, bias=cache.bias)
                compute += time.perf_counter() - t0
                inserted, evicted = inserted + s.inserted, evicted + s.total_evicted
                mem, io = mem + s.mem_s, io + s.io_s
                load.append(s.inserted)
            t = len(trace_ids)
            per_round.append((inserted / t, evicted / t, mem / t * 1e3, io / t * 1e3, compute / t * 1e3))
            loads[window] = load
        med = [statistics.median(r[i] for r in per_round) for i in range(5)]
        rows.append(
            {
                "bench": "cache",
                "window": window,
                "insert_per_token": med[0],
                "evict_per_token": med[1],
                "mem_ms_per_token": med[2],
                "io_ms_per_token": med[3],
                "compute_ms_per_token": med[4],
                "mem_over_compute": med[2] / med[4],
                "trace": info,
                "device": device_name(),
            }
        )
        on_row(rows[-1])
    store.close()  # every cache read through the store's one reader
    if plots:
        plot_cache(trace, loads, info)
    return rows


def plot_cache(trace: torch.Tensor, loads: dict[int, list[int]], info: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    RESULTS.mkdir(parents=True, exist_ok=True)
    used = torch.cumsum(trace.float(), 0).gt(0).float().mean(1) * 100  # % of neurons used at least once so far
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(range(1, len(used) + 1), used.numpy())
    ax.set_xlabel("tokens")
    ax.set_ylabel("aggregated neuron usage (%)")
    ax.set_title(
        f"Fig. 4a analogue: {info['model']} masks, {1 - info['achieved_sparsity']:.1%} active/token", fontsize=9
    )
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / "bench_ffn_neuron_usage.png", dpi=120)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    windows = sorted(loads)
    ax.plot(windows, [statistics.mean(loads[k][1:]) for k in windows], marker="o")
    ax.set_xlabel("window k (tokens)")
    ax.set_ylabel("neurons loaded per token")
    ax.set_title("per-token load vs window (OPT-6.7B-shaped layer)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / "bench_ffn_load_vs_window.png", dpi=120)


def main() -> None:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["ffn", "qffn", "cache"])
    parser.add_argument("--quick", action="store_true", help="one sparsity, T=1, a short trace (smoke run)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where benches 'ffn' and 'qffn' run (bench 'cache' is CPU only until the cache runs on a GPU)",
    )
    parser.add_argument(
        "--store-dir",
        type=Path,
        default=None,
        help="where the synthetic OPT-6.7B-shaped store lives (default: a temporary folder)",
    )
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.rounds = 1
        if args.only is None:
            args.only = "ffn"
            print(
                "--smoke: bench 'cache' skipped (its trace and store are the default model's and a 7B layer's)",
                file=sys.stderr,
            )
    on_row = (lambda row: emit([row], True)) if args.json else (lambda row: None)  # tables wait for every row
    if args.only in (None, "ffn"):
        rows = bench_ffn(args.dtype, args.rounds, args.quick, args.device, args.smoke, on_row)
        if not args.json:
            emit(
                rows,
                False,
                [
                    "shape",
                    "dtype",
                    "sparsity",
                    "tokens",
                    "rows",
                    "sparse_ms",
                    "dense_ms",
                    "speedup",
                    "bound_ms",
                    "bound_ratio",
                    "stream_gbps",
                    "sparse_1t_ms",
                    "bound_ratio_1t",
                    "sparse_graph_ms",
                    "bound_ratio_graph",
                ],
            )
    if args.only in (None, "qffn"):
        rows = bench_quantized_ffn(args.rounds, args.quick, args.device, args.smoke, on_row)
        if not args.json:
            columns = ["bundle_format", "density", "tokens", "rows", "row_bytes", "quantized_ms", "fp16_ms"]
            columns += ["speedup_vs_fp16", "bound_ms", "bound_ratio", "stream_gbps"]
            columns += ["quantized_graph_ms", "bound_ratio_graph"] if args.device == "cuda" else []
            columns += ["quantized_1t_ms", "bound_ratio_1t"] if args.device == "cpu" else []
            emit(rows, False, columns)
    if args.only in (None, "cache"):
        with tempfile.TemporaryDirectory(dir=os.getcwd(), prefix=".bench-ffn-") as tmp:
            store_dir = args.store_dir or Path(tmp) / "opt-6.7b-layer"
            rows = bench_cache(args.rounds, args.quick, args.dtype, store_dir, not args.no_plots, on_row)
            if not args.json:
                emit(
                    rows,
                    False,
                    [
                        "window",
                        "insert_per_token",
                        "evict_per_token",
                        "mem_ms_per_token",
                        "io_ms_per_token",
                        "compute_ms_per_token",
                        "mem_over_compute",
                    ],
                )


if __name__ == "__main__":
    main()
