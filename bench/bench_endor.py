"""Endor kernels on the FFN and attention shapes of OPT-6.7B and Llama-2-7B at 50% unstructured sparsity.

op "decompress": throughput of the native kernel vs memcpy of the same output, the pure-torch reference, and
torch's sparse CSR to_dense. decompress_gbps is GB/s of dense output written into a preallocated `out`;
memcpy_gbps is `out.copy_(dense)` into the same buffer, timed interleaved in the same process. Nothing allocates
inside the timed region, except CSR to_dense, which has no out= variant (its row says so).

op "linear": the decode GEMV y = x W^T, T = 1 and 4 tokens, weight and x in fp16 and in bf16 (the CPU's avx512bf16
path multiplies bf16 pairs without widening them): endor_linear (straight from values + bitmap) vs the dense
baselines on the same weight: torch F.linear on it (vs_dense), flashllm's half_linear on it, torch F.linear in
float32 on a float32 copy (twice the bytes); vs_best_dense is against the fastest of the three (best_dense names
it); and vs decompress (into a preallocated buffer) + F.linear; same threads (OMP_NUM_THREADS sets torch's and
endor_linear's; the row's `threads`), interleaved. Each side's bytes (compressed: values + bitmap + row
offsets; dense: the weight) divided by the read bandwidth of a streaming sum measured in the same run
(common.stream_probe) give its bandwidth bound; bound_ratio = time / bound (1.0 = at the bound). A weight is 34-134 MB
(compressed 19-76 MB), read once per call; each candidate cycles through `weight_copies` copies of it, enough to
span twice the last-level cache, so every call reads its weight from DRAM as decode does.

    python -m bench.bench_endor [--json] [--device cuda] [--all-isas] [--quick] [--only decompress|linear]
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.common import arg_parser, cycling, device_name, emit, last_level_cache_bytes, stream_probe, time_interleaved

import flashllm_ext
from flashllm_ext import endor, ops
from flashllm_ext.flash import store
from flashllm_ext.ops import endor_decompress_reference

SHAPES = {
    "opt-6.7b fc1": (16384, 4096),
    "opt-6.7b fc2": (4096, 16384),
    "llama-2-7b up": (11008, 4096),
    "llama-2-7b down": (4096, 11008),
    # q/k/v/o of both (d = 4096, 32 heads of 128): what offloaded inference also computes per layer
    "opt-6.7b / llama-2-7b attn": (4096, 4096),
}
SMOKE_SHAPES = {"smoke (fc1-like)": (256, 128), "smoke (fc2-like)": (64, 512)}
DTYPES = {name: store.DTYPES[name] for name in ("fp16", "bf16")}


def pruned_weight(shape: tuple[int, int], dtype: torch.dtype, sparsity: float, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g).to(dtype)
    w[torch.rand(shape, generator=g) < sparsity] = 0  # unstructured, as magnitude pruning of random weights gives
    return w.to(device)


def bench_case(
    name: str,
    shape: tuple[int, int],
    dtype_name: str,
    sparsity: float,
    rows_fraction: float | None,
    device: str,
    rounds: int,
    with_baselines: bool,
) -> dict:
    dtype = DTYPES[dtype_name]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dense = pruned_weight(shape, dtype, sparsity, device)
    e = endor.compress(dense)
    rows = None
    if rows_fraction is not None:
        n = max(1, int(shape[0] * rows_fraction))
        rows = torch.randperm(shape[0], generator=torch.Generator().manual_seed(1))[:n].to(device)
        dense = dense[rows].contiguous()  # memcpy baseline copies exactly the output the subset decompress writes
    out = torch.zeros_like(dense)  # touched now: page faults stay out of the timed region
    assert torch.equal(e.decompress(rows, out=out), dense), "decompressed output differs from the dense weight"
    candidates = {"decompress": lambda: e.decompress(rows, out=out), "memcpy": lambda: out.copy_(dense)}
    if with_baselines:
        candidates["reference"] = lambda: endor_decompress_reference(
            e.values, e.bitmap, e.row_offsets, shape[1], rows, out=out
        )
        if rows is None:
            csr = dense.to_sparse_csr()
            candidates["csr"] = lambda: csr.to_dense()
    times = time_interleaved(candidates, rounds=rounds, sync=sync)
    gb = dense.numel() * dense.element_size() / 1e9
    row = {
        "bench": "endor",
        "op": "decompress" if rows is None else f"decompress_rows_{rows_fraction:.0%}",
        "shape": f"{shape[0]}x{shape[1]}",
        "matrix": name,
        "dtype": dtype_name,
        "sparsity": sparsity,
        "compressed_ratio": e.nbytes / e.dense_nbytes,
        "decompress_gbps": gb / times["decompress"],
        "memcpy_gbps": gb / times["memcpy"],
        "vs_memcpy": times["memcpy"] / times["decompress"],
    }
    if with_baselines:
        row["reference_gbps"] = gb / times["reference"]
        row["vs_reference"] = times["reference"] / times["decompress"]
        row["csr_gbps"] = gb / times["csr"] if "csr" in times else None
    row["device"] = device_name(device)
    return row


def bench_linear_case(
    name: str,
    shape: tuple[int, int],
    dtype_name: str,
    n_tok: int,
    sparsity: float,
    device: str,
    rounds: int,
    stream: tuple[int, Callable[[], object]],
    copies: int | None = None,
) -> dict:
    """copies: of the weight each candidate cycles through (default: enough to span twice the last-level cache)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dtype = DTYPES[dtype_name]
    dense = pruned_weight(shape, dtype, sparsity, device)
    e = endor.compress(dense)
    x = torch.randn(n_tok, shape[1], generator=torch.Generator().manual_seed(2)).to(device, dtype)
    buffer = torch.zeros_like(dense)  # touched now: page faults stay out of the timed region
    x_fp32 = x.float()
    want = F.linear(x_fp32, dense.float())
    got = ops.endor_linear(x, e.values, e.bitmap, e.row_offsets, n_cols=shape[1])
    assert torch.allclose(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item()), "endor_linear wrong"
    probe_bytes, probe = stream
    # Decode reads each weight once per token from DRAM (every other layer's weights pass through the cache in
    # between). Calls back to back on one weight that fits the last-level cache (the attention shape's 19 MB
    # compressed on a 32 MB L3, or any of these on a 50-60 MB GPU L2) would read it from there instead, so each
    # candidate cycles through enough copies of its weight to span twice that cache.
    copies = copies or math.ceil(2 * last_level_cache_bytes(device) / e.nbytes)
    denses = [dense] + [dense.clone() for _ in range(copies - 1)]
    es, dense_fp32s = [e] + [endor.compress(w) for w in denses[1:]], [w.float() for w in denses]
    times = time_interleaved(
        {
            "endor_linear": cycling(
                lambda i: ops.endor_linear(x, es[i].values, es[i].bitmap, es[i].row_offsets, n_cols=shape[1]), copies
            ),
            "dense": cycling(lambda i: F.linear(x, denses[i]), copies),
            "half_linear": cycling(lambda i: ops.half_linear(x, denses[i]), copies),
            "dense_fp32": cycling(lambda i: F.linear(x_fp32, dense_fp32s[i]), copies),
            "decompress_linear": cycling(lambda i: F.linear(x, es[i].decompress(out=buffer)), copies),
            "stream": probe,
        },
        rounds=rounds,
        sync=sync,
    )
    bandwidth = probe_bytes / times["stream"]
    dense_bytes = dense.numel() * dense.element_size()
    best_dense = min(("dense", "half_linear", "dense_fp32"), key=times.__getitem__)
    return {
        "bench": "endor",
        "op": "linear",
        "shape": f"{shape[0]}x{shape[1]}",
        "matrix": name,
        "dtype": dtype_name,
        "sparsity": sparsity,
        "tokens": n_tok,
        "endor_mb": e.nbytes / 1e6,
        "dense_mb": dense_bytes / 1e6,
        "bytes_ratio": e.nbytes / dense_bytes,
        "endor_ms": times["endor_linear"] * 1e3,
        "dense_ms": times["dense"] * 1e3,
        "half_linear_ms": times["half_linear"] * 1e3,
        "dense_fp32_ms": times["dense_fp32"] * 1e3,
        "decompress_linear_ms": times["decompress_linear"] * 1e3,
        "vs_dense": times["dense"] / times["endor_linear"],
        "best_dense": best_dense,
        "vs_best_dense": times[best_dense] / times["endor_linear"],
        "vs_decompress_linear": times["decompress_linear"] / times["endor_linear"],
        "stream_gbps": bandwidth / 1e9,
        "endor_gbps": e.nbytes / times["endor_linear"] / 1e9,
        "bound_ratio": times["endor_linear"] / (e.nbytes / bandwidth),
        "dense_bound_ratio": times["dense"] / (dense_bytes / bandwidth),
        "threads": torch.get_num_threads(),
        "weight_copies": copies,
        "device": device_name(device),
    }


def main() -> None:
    parser = arg_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--all-isas", action="store_true", help="repeat the CPU runs for every ISA path")
    parser.add_argument("--quick", action="store_true", help="one shape, fp16 only")
    parser.add_argument("--no-baselines", action="store_true", help="skip the slow reference and CSR baselines")
    parser.add_argument("--only", choices=["decompress", "linear"], help="run one op's rows")
    args = parser.parse_args()
    if args.smoke:  # timed, not measured: the rows prove the script
        args.quick, args.rounds = True, 1
    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
    isas = [flashllm_ext._C.detected_cpu_isa()]
    if args.all_isas:
        order = flashllm_ext._C.cpu_isas()
        isas = list(order[: order.index(isas[0]) + 1])
    shapes = SMOKE_SHAPES if args.smoke else dict(list(SHAPES.items())[:1]) if args.quick else SHAPES
    dtypes = ["fp16"] if args.quick else list(DTYPES)
    rows = []
    for isa in isas if args.device == "cpu" else [None]:
        if isa:
            flashllm_ext._C.set_cpu_isa(isa)
        if args.only != "linear":
            for name, shape in shapes.items():
                for dtype_name in dtypes:
                    for fraction in (None, 0.05):
                        row = bench_case(
                            name,
                            shape,
                            dtype_name,
                            0.5,
                            fraction,
                            args.device,
                            args.rounds,
                            with_baselines=not args.no_baselines,
                        )
                        rows.append(row)
                        if args.json:
                            emit([row], True)
        if args.only != "decompress":
            stream = stream_probe(args.device, args.smoke)
            for name, shape in shapes.items():
                for dtype_name in dtypes:
                    for n_tok in (1,) if args.quick else (1, 4):
                        row = bench_linear_case(
                            name,
                            shape,
                            dtype_name,
                            n_tok,
                            0.5,
                            args.device,
                            args.rounds,
                            stream,
                            copies=2 if args.smoke else None,
                        )
                        rows.append(row)
                        if args.json:
                            emit([row], True)
    if not args.json:
        emit(
            [r for r in rows if r["op"] != "linear"],
            False,
            [
                "op",
                "matrix",
                "shape",
                "dtype",
                "compressed_ratio",
                "decompress_gbps",
                "memcpy_gbps",
                "vs_memcpy",
                "reference_gbps",
                "vs_reference",
                "csr_gbps",
                "device",
            ],
        )
        emit(
            [r for r in rows if r["op"] == "linear"],
            False,
            [
                "matrix",
                "shape",
                "dtype",
                "tokens",
                "bytes_ratio",
                "endor_ms",
                "dense_ms",
                "half_linear_ms",
                "dense_fp32_ms",
                "vs_dense",
                "best_dense",
                "vs_best_dense",
                "decompress_linear_ms",
                "vs_decompress_linear",
                "endor_gbps",
                "stream_gbps",
                "bound_ratio",
                "dense_bound_ratio",
                "device",
            ],
        )


if __name__ == "__main__":
    main()
