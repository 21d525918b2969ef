"""The quant predictor's scoring (flashllm::quant_scores) per layer call: the native CPU kernel against the
pure-torch reference (dequantise every row, then matmul), and against the layer's sparse FFN compute (ops.sparse_ffn
over the loaded rows at the given density), on the default model's FFN shapes, interleaved in one process (medians).

    python bench/bench_quant_scores.py [--tokens 1,8] [--density 0.7] [--json]
"""
from __future__ import annotations

import math

import torch

from common import arg_parser, device_name, emit, time_interleaved

from flashllm_ext import ops
from flashllm_ext._ops import quant_scores_reference


def main() -> None:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=576, help="d (default model: 576)")
    parser.add_argument("--neurons", type=int, default=1536, help="n (default model: 1536)")
    parser.add_argument("--gate-bits", type=int, default=4)
    parser.add_argument("--up-bits", type=int, default=2)
    parser.add_argument("--density", type=float, default=0.7, help="loaded density of the sparse FFN compared with")
    parser.add_argument("--tokens", default="1,8", help="comma-separated T")
    parser.add_argument("--dtype", default="float16", help="the store's dtype (sparse_ffn's x and rows)")
    args = parser.parse_args()
    d, n, dtype = args.hidden, args.neurons, getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    up_codes = torch.randint(0, 256, (n, math.ceil(d * args.up_bits / 8)), dtype=torch.uint8, generator=g)
    gate_codes = torch.randint(0, 256, (n, math.ceil(d * args.gate_bits / 8)), dtype=torch.uint8, generator=g)
    up_scale, gate_scale = (torch.rand(n, generator=g) * 0.01).half(), (torch.rand(n, generator=g) * 0.01).half()
    rows = round(args.density * n)
    matrix = (torch.randn(n, 3 * d, generator=g) * 0.02).to(dtype)
    rows_out = []
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, d, generator=g).to(dtype)
        quant = (x, up_codes, up_scale, None, gate_codes, gate_scale, None, args.up_bits, args.gate_bits, "silu")
        times = time_interleaved({
            "native": lambda: ops.quant_scores(x, up_codes, up_scale, up_bits=args.up_bits, gate_codes=gate_codes,
                                               gate_scale=gate_scale, gate_bits=args.gate_bits),
            "reference": lambda: quant_scores_reference(*quant),
            "sparse_ffn": lambda: ops.sparse_ffn(x, matrix, num_used=rows, activation="silu", glu=True),
        }, rounds=args.rounds)
        code_bytes = up_codes.numel() + gate_codes.numel()
        rows_out.append({"T": T, "d": d, "n": n, "bits gate/up": f"{args.gate_bits}/{args.up_bits}",
                         "native ms": round(times["native"] * 1e3, 3),
                         "reference ms": round(times["reference"] * 1e3, 3),
                         "reference / native": round(times["reference"] / times["native"], 1),
                         f"sparse_ffn ms (density {args.density})": round(times["sparse_ffn"] * 1e3, 3),
                         "native / sparse_ffn": round(times["native"] / times["sparse_ffn"], 3),
                         "code GB/s": round(code_bytes / times["native"] / 1e9, 2),
                         "device": device_name()})
    emit(rows_out, args.json)


if __name__ == "__main__":
    main()
