"""Endor decompression throughput: native kernel vs memcpy of the same output, the pure-torch reference, and
torch's sparse CSR to_dense, on the FFN shapes of OPT-6.7B and Llama-2-7B at 50% unstructured sparsity.

decompress_gbps is GB/s of dense output written into a preallocated `out`; memcpy_gbps is `out.copy_(dense)`
into the same buffer, timed interleaved in the same process. Nothing allocates inside the timed region, except
CSR to_dense, which has no out= variant (its row says so).

    python bench/bench_endor.py [--json] [--device cuda] [--all-isas] [--quick]
"""
from __future__ import annotations

import warnings

import torch

from common import device_name, arg_parser, emit, time_interleaved

import flashllm_ext
from flashllm_ext import endor, store
from flashllm_ext._ops import endor_decompress_reference

SHAPES = {"opt-6.7b fc1": (16384, 4096), "opt-6.7b fc2": (4096, 16384),
          "llama-2-7b up": (11008, 4096), "llama-2-7b down": (4096, 11008)}
DTYPES = {name: store.DTYPES[name] for name in ("fp16", "bf16")}


def pruned_weight(shape: tuple[int, int], dtype: torch.dtype, sparsity: float, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g).to(dtype)
    w[torch.rand(shape, generator=g) < sparsity] = 0  # unstructured, as magnitude pruning of random weights gives
    return w.to(device)


def bench_case(name: str, shape: tuple[int, int], dtype_name: str, sparsity: float, rows_fraction: float | None,
               device: str, rounds: int, with_baselines: bool) -> dict:
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
        candidates["reference"] = lambda: endor_decompress_reference(e.values, e.bitmap, e.row_offsets, shape[1],
                                                                     rows, out=out)
        if rows is None:
            csr = dense.to_sparse_csr()
            candidates["csr"] = lambda: csr.to_dense()
    times = time_interleaved(candidates, rounds=rounds, sync=sync)
    gb = dense.numel() * dense.element_size() / 1e9
    row = {"bench": "endor", "op": "decompress" if rows is None else f"decompress_rows_{rows_fraction:.0%}",
           "shape": f"{shape[0]}x{shape[1]}", "matrix": name, "dtype": dtype_name, "sparsity": sparsity,
           "compressed_ratio": e.nbytes / e.dense_nbytes, "decompress_gbps": gb / times["decompress"],
           "memcpy_gbps": gb / times["memcpy"], "vs_memcpy": times["memcpy"] / times["decompress"]}
    if with_baselines:
        row["reference_gbps"] = gb / times["reference"]
        row["vs_reference"] = times["reference"] / times["decompress"]
        row["csr_gbps"] = gb / times["csr"] if "csr" in times else None
    row["device"] = device_name(device)
    return row


def main() -> None:
    parser = arg_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--all-isas", action="store_true", help="repeat the CPU runs for every ISA path")
    parser.add_argument("--quick", action="store_true", help="one shape, fp16 only")
    parser.add_argument("--no-baselines", action="store_true", help="skip the slow reference and CSR baselines")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
    isas = [flashllm_ext._C.detected_cpu_isa()]
    if args.all_isas:
        order = ["scalar", "avx2", "avx512", "avx512vbmi2"]
        isas = order[:order.index(isas[0]) + 1]
    shapes = dict(list(SHAPES.items())[:1]) if args.quick else SHAPES
    dtypes = ["fp16"] if args.quick else list(DTYPES)
    rows = []
    for isa in isas if args.device == "cpu" else [None]:
        if isa:
            flashllm_ext._C.set_cpu_isa(isa)
        for name, shape in shapes.items():
            for dtype_name in dtypes:
                for fraction in (None, 0.05):
                    row = bench_case(name, shape, dtype_name, 0.5, fraction, args.device, args.rounds,
                                     with_baselines=not args.no_baselines)
                    rows.append(row)
                    if args.json:
                        emit([row], True)
    if not args.json:
        emit(rows, False, ["op", "matrix", "shape", "dtype", "compressed_ratio", "decompress_gbps", "memcpy_gbps",
                           "vs_memcpy", "reference_gbps", "vs_reference", "csr_gbps", "device"])


if __name__ == "__main__":
    main()
