"""The quant predictor's scoring (flashllm::quant_scores) per layer call: the native CPU kernel on each of its paths
(AVX-512 VNNI integer dot products, the AVX-512 fp32 FMA path, the AVX2 int16 path, the scalar byte tables, forced
with flashllm_ext._C.set_cpu_isa),
optionally the pure-torch reference (dequantise every row, then matmul), against the layer's sparse FFN compute
(ops.sparse_ffn over the loaded rows at the operating density), interleaved in one process (medians).

Shapes (--shape): `default` = the default model at the default predictor (d=576, n=1536, W_gate 3 / W_up 4 bits, one
scale per 192 columns, density 0.45, 30 layers);
`opt-6.7b` = d=4096, n=16384, no gate (fc1 at 4 bits), ReLU, the end-to-end run's operating point (a) density 0.06;
`llama-2-7b` = d=4096, n=11008, W_gate 4 / W_up 4 bits, density 0.06. Each call scores the next of --layers copies of
the codes (and runs the next copy's FFN rows), so a 7B shape reads its codes from DRAM as the engine does, not from a
cache holding one layer. Codes and weights are random (the speed does not depend on their values).

    python -m bench.bench_quant_scores [--shape default|opt-6.7b|llama-2-7b] [--tokens 1,8] [--threads 1,2] [--json]
"""

from __future__ import annotations

import itertools
import math

import torch

from bench.common import arg_parser, device_name, emit, stream_probe, time_interleaved

from flashllm_ext import _C, ops
from flashllm_ext.ops import quant_scores_reference

# name: (d, n, gate bits (None: no gate), up bits, columns per scale (None: one per row), activation, density, layers)
SHAPES = {
    "default": (576, 1536, 3, 4, 192, "silu", 0.45, 30),  # --smoke: d 64, n 192 (a group of 64 columns)
    "opt-6.7b": (4096, 16384, None, 4, None, "relu", 0.06, 8),
    "llama-2-7b": (4096, 11008, 4, 4, None, "silu", 0.06, 8),
}
# quant_scores' native paths, fastest first (a level without a path of its own runs the one below).
PATHS = ("avx512vbmi2", "avx512vnni", "avx512", "avx2", "scalar")


def main() -> None:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="default")
    parser.add_argument("--hidden", type=int, default=None, help="d (default: the shape's)")
    parser.add_argument("--neurons", type=int, default=None, help="n (default: the shape's)")
    parser.add_argument("--gate-bits", type=int, default=None, help="0 for no gate (default: the shape's)")
    parser.add_argument("--up-bits", type=int, default=None)
    parser.add_argument(
        "--group-size", type=int, default=None, help="columns per scale, 0 for one per row (default: the shape's)"
    )
    parser.add_argument("--density", type=float, default=None, help="loaded density of the sparse FFN compared with")
    parser.add_argument("--layers", type=int, default=None, help="copies of the layer cycled through")
    parser.add_argument("--tokens", default="1,8", help="comma-separated T")
    parser.add_argument("--threads", default=None, help="comma-separated OpenMP thread counts (default: as set)")
    parser.add_argument(
        "--paths",
        default=None,
        help=f"comma-separated native paths to time, among {', '.join(PATHS)} (default: all this CPU runs)",
    )
    parser.add_argument("--reference", action="store_true", help="also time the pure-torch reference")
    parser.add_argument(
        "--stream",
        action="store_true",
        help="also time the memory-bandwidth probe (a 512 MiB sum), the bound of a scorer reading its codes from DRAM",
    )
    parser.add_argument("--dtype", default="float16", help="the store's dtype (sparse_ffn's x and rows)")
    args = parser.parse_args()
    if args.smoke:  # the default model's layout at a tenth of its width, one token, one round
        args.hidden, args.neurons, args.group_size, args.layers, args.tokens, args.rounds = 64, 192, 64, 2, "1", 1
    d, n, gate_bits, up_bits, group_size, activation, density, layers = SHAPES[args.shape]
    d, n, up_bits = args.hidden or d, args.neurons or n, args.up_bits or up_bits
    group_size = group_size if args.group_size is None else (args.group_size or None)
    scale_shape = (n,) if group_size is None else (n, d // group_size)
    gate_bits = gate_bits if args.gate_bits is None else (args.gate_bits or None)
    density, layers = args.density or density, args.layers or layers
    dtype, glu = getattr(torch, args.dtype), gate_bits is not None
    order = _C.cpu_isas()
    paths = (
        args.paths.split(",")
        if args.paths
        else [p for p in PATHS if order.index(p) <= order.index(_C.detected_cpu_isa())]
    )

    g = torch.Generator().manual_seed(0)

    def codes(bits: int) -> torch.Tensor:
        return torch.randint(0, 256, (n, math.ceil(d * bits / 8)), dtype=torch.uint8, generator=g)

    rows = round(density * n)
    copies = [
        {
            "up_codes": codes(up_bits),
            "up_scale": (torch.rand(scale_shape, generator=g) * 0.01).half(),
            "gate_codes": codes(gate_bits) if glu else None,
            "gate_scale": (torch.rand(scale_shape, generator=g) * 0.01).half() if glu else None,
            # only the loaded rows: sparse_ffn reads rows [0, num_used)
            "matrix": (torch.randn(rows, (3 if glu else 2) * d, generator=g) * 0.02).to(dtype),
        }
        for _ in range(layers)
    ]
    code_bytes = copies[0]["up_codes"].numel() + (copies[0]["gate_codes"].numel() if glu else 0)

    def cycling(call):
        layer = itertools.cycle(copies)
        return lambda: call(next(layer))

    def native(isa: str, x: torch.Tensor):
        def call(c):
            _C.set_cpu_isa(isa)
            return ops.quant_scores(
                x,
                c["up_codes"],
                c["up_scale"],
                up_bits=up_bits,
                gate_codes=c["gate_codes"],
                gate_scale=c["gate_scale"],
                gate_bits=gate_bits or 4,
                activation=activation,
            )

        return cycling(call)

    probe_bytes, probe = stream_probe() if args.stream else (0, None)
    previous_isa, previous_threads = _C.cpu_isa(), torch.get_num_threads()
    out = []
    for threads in [int(t) for t in args.threads.split(",")] if args.threads else [previous_threads]:
        torch.set_num_threads(threads)
        for T in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(T, d, generator=g).to(dtype)
            candidates = {p: native(p, x) for p in paths}
            if args.reference:
                candidates["reference"] = cycling(
                    lambda c: quant_scores_reference(
                        x,
                        c["up_codes"],
                        c["up_scale"],
                        None,
                        c["gate_codes"],
                        c["gate_scale"],
                        None,
                        up_bits,
                        gate_bits or 4,
                        activation,
                    )
                )

            def ffn(c):
                _C.set_cpu_isa(previous_isa)  # the FFN on this CPU's own path, whichever scorer path ran last
                return ops.sparse_ffn(x, c["matrix"], num_used=rows, activation=activation, glu=glu)

            candidates["sparse_ffn"] = cycling(ffn)
            if probe is not None:
                candidates["stream"] = probe
            times = time_interleaved(candidates, rounds=args.rounds)
            _C.set_cpu_isa(previous_isa)
            ffn = times["sparse_ffn"]
            row = {
                "shape": args.shape,
                "threads": threads,
                "T": T,
                "d": d,
                "n": n,
                "bits gate/up": f"{gate_bits or '-'}/{up_bits}",
                "group": group_size or "row",
                "layers": layers,
            }
            for name in candidates:
                if name not in ("sparse_ffn", "stream"):
                    row[f"{name} ms"] = round(times[name] * 1e3, 3)
                    row[f"{name} / sparse_ffn"] = round(times[name] / ffn, 3)
            if "avx512vnni" in times and "avx512" in times:
                row["avx512 / avx512vnni"] = round(times["avx512"] / times["avx512vnni"], 2)
            if "scalar" in times and "avx2" in times:
                row["scalar / avx2"] = round(times["scalar"] / times["avx2"], 2)
            if "avx512vnni" in times and "avx512vbmi2" in times:
                row["avx512vnni / avx512vbmi2"] = round(times["avx512vnni"] / times["avx512vbmi2"], 2)
            row[f"sparse_ffn ms (density {density})"] = round(ffn * 1e3, 3)
            row[f"{paths[0]} code GB/s"] = round(code_bytes / times[paths[0]] / 1e9, 2)
            if probe is not None:
                row["stream GB/s"] = round(probe_bytes / times["stream"] / 1e9, 2)
            row["device"] = device_name()
            out.append(row)
            if args.json:  # as measured; the table waits for every row
                emit([row], True)
    torch.set_num_threads(previous_threads)
    if not args.json:
        emit(out, False)


if __name__ == "__main__":
    main()
