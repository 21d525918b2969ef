"""flashllm::half_linear (y = x W^T + b from fp16 / bf16 weights, fp32 math) against PyTorch's F.linear on the same
half-precision weights and on an fp32 copy, on the shapes a flash-loaded model keeps resident (the default model's
attention projection and LM head, OPT-6.7B's / Llama-2-7B's attention projection), interleaved in one process
(medians); the bound is the weight bytes over the read bandwidth of a streaming sum measured in the same run. Beside
them flashllm::quantized_linear on the same weights in Q8_0 and Q4_0 blocks ("q8_0 ms", "q4_0 ms": a quantized store's
resident linears), each against the bound of its own bytes.

    python -m bench.bench_half_linear [--tokens 1,8,64] [--dtype float16] [--json]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.common import arg_parser, device_name, emit, stream_probe, time_interleaved

from flashllm_ext import ops
from flashllm_ext.ops.blocks import quantize_rows

QUANTIZED = ("q8_0", "q4_0")

SHAPES = {
    "default q_proj (576 x 576)": (576, 576),
    "default lm_head (49152 x 576)": (49152, 576),
    "7B q_proj (4096 x 4096)": (4096, 4096),
}
SMOKE_SHAPES = {"smoke (96 x 64)": (96, 64)}


def main() -> None:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,8,64", help="comma-separated T")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.rounds = "1", 1
    dtype, g = getattr(torch, args.dtype), torch.Generator().manual_seed(0)
    probe_bytes, stream = stream_probe(smoke=args.smoke)
    rows = []
    for name, (n, d) in (SMOKE_SHAPES if args.smoke else SHAPES).items():
        w32 = torch.randn(n, d, generator=g) / d**0.5
        w = w32.to(dtype)
        blocks = {fmt: quantize_rows(w32, fmt) for fmt in QUANTIZED}
        for T in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(T, d, generator=g).to(dtype)
            x32 = x.float()
            times = time_interleaved(
                {
                    "native": lambda: ops.half_linear(x, w),
                    "torch": lambda: F.linear(x, w),
                    "torch fp32": lambda: F.linear(x32, w32),
                    "stream": stream,
                    **{
                        fmt: (lambda fmt=fmt: ops.quantized_linear(x, blocks[fmt], weight_format=fmt))
                        for fmt in QUANTIZED
                    },
                },
                rounds=args.rounds,
            )
            bound = w.nbytes / (probe_bytes / times["stream"])
            rows.append(
                {
                    "shape": name,
                    "T": T,
                    "dtype": args.dtype,
                    "native ms": round(times["native"] * 1e3, 3),
                    "torch ms": round(times["torch"] * 1e3, 3),
                    "torch / native": round(times["torch"] / times["native"], 2),
                    "torch fp32 ms": round(times["torch fp32"] * 1e3, 3),
                    "torch fp32 / native": round(times["torch fp32"] / times["native"], 2),
                    "native / bound": round(times["native"] / bound, 2),
                    **{f"{fmt} ms": round(times[fmt] * 1e3, 3) for fmt in QUANTIZED},
                    **{
                        f"{fmt} / its bound": round(
                            times[fmt] / (blocks[fmt].nbytes / (probe_bytes / times["stream"])), 2
                        )
                        for fmt in QUANTIZED
                    },
                    "device": device_name(),
                }
            )
            if args.json:  # as measured; the table waits for every row
                emit(rows[-1:], True)
    if not args.json:
        emit(rows, False)


if __name__ == "__main__":
    main()
