"""The MLX engine (flashllm_ext.mlx.load_flash) against the torch engine (flashllm_ext.load_decoder) on the default
model's flash store (--store: fp16, or q8 / q4 bundles), in one process: greedy decode milliseconds per token in each mode at one DRAM budget, the
per-token breakdown (I/O, memory management, predictor, FFN compute), bytes read and whether the tokens equal the
torch engine's dense ones. The models (each mode on both engines) run round-robin (the order rotated every round)
and each figure is the median over the rounds. Where MLX runs on the CPU (Linux: mlx[cpu]) this measures the same
engine on a different array library, not Apple Silicon. A second table times the largest resident product, the LM head's GEMV
(49152 x 576, one token), on both libraries in fp16 and fp32 (interleaved medians): where the decode time goes.

    python -m bench.bench_mlx [--budget 50%] [--tokens 16] [--rounds 3] [--modes dense,naive,hybrid,flash]
                              [--store fp16|q8|q4] [--mlx-fp32] [--json]
"""

from __future__ import annotations

import statistics

import mlx.core as mx
import torch
import torch.nn.functional as F

from bench.common import arg_parser, device_name, emit, time_interleaved

import flashllm_ext
from flashllm_ext import mlx as fmlx
from flashllm_ext.demos.flash import greedy_decode, prepare_store
from flashllm_ext.mlx.transfer import to_mx
from flashllm_ext.hub import fetch_default, resolve_cache_dir

PROMPT = "The three primary colors are"
BREAKDOWN = ("io_ms", "mem_ms", "predictor_ms", "compute_ms", "bytes_per_token", "hit_rate")


def lm_head_rows(rounds: int) -> list[dict]:
    """ms of x W^T for W [49152, 576] and one token, torch (F.linear) and mlx, fp16 and fp32, interleaved."""
    w32 = torch.randn(49152, 576, generator=torch.Generator().manual_seed(0)) / 24
    x32 = torch.randn(1, 576, generator=torch.Generator().manual_seed(1))
    candidates = {}
    for name, dtype in (("fp16", torch.float16), ("fp32", torch.float32)):
        w, x = w32.to(dtype), x32.to(dtype)
        mw, mxx = to_mx(w), to_mx(x)
        candidates[("torch", name)] = lambda w=w, x=x: F.linear(x, w)
        candidates[("mlx", name)] = lambda w=mw, x=mxx: mx.eval(x @ w.T)
    times = time_interleaved(candidates, rounds=rounds)
    return [
        {"bench": "mlx", "product": "lm_head GEMV 49152x576", "engine": engine, "dtype": dtype, "ms": seconds * 1e3}
        for (engine, dtype), seconds in times.items()
    ]


def main() -> None:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--budget", default="50%", help="DRAM budget of every mode but dense (bytes, share, size)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens generated per run (decode: one fewer)")
    parser.add_argument(
        "--modes",
        default="dense,flash",
        help="comma-separated: dense, naive, hybrid, flash, exact (both engines run each)",
    )
    parser.add_argument(
        "--mlx-fp32",
        action="store_true",
        help="one more MLX dense model with fp32 resident tensors and FFNs (mlx's CPU device has no fast fp16 product)",
    )
    parser.add_argument("--store", choices=["fp16", "q8", "q4"], default="fp16", help="the store's format (convert's)")
    parser.set_defaults(rounds=3)
    args = parser.parse_args()
    if args.smoke:  # the default model is the smallest there is: a few tokens, one round
        args.tokens, args.rounds = 3, 1
    from transformers import AutoTokenizer

    gguf = fetch_default()
    store_dir = prepare_store(gguf, resolve_cache_dir(), args.store)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    models, runs = {}, {}
    for mode in args.modes.split(","):
        budget = None if mode == "dense" else args.budget
        models[("torch", mode, "fp16")] = flashllm_ext.load_decoder(
            store_dir, budget, mode=mode, max_len=prompt.shape[1] + args.tokens
        )
        models[("mlx", mode, "fp16")] = fmlx.load_flash(store_dir, dram_budget=budget, mode=mode)
    if args.mlx_fp32:
        models[("mlx", "dense", "fp32")] = fmlx.load_flash(store_dir, mode="dense", dtype=torch.float32)

    def run(engine: str, mode: str, dtype: str) -> dict:
        model = models[(engine, mode, dtype)]
        if engine == "torch":
            ids, seconds = greedy_decode(model, prompt[0].tolist(), args.tokens)
            stats = model.stats() if model.runtime is not None else {}
        else:
            ids, seconds = model.greedy_decode(prompt, args.tokens)
            stats = model.stats() if model.runtime is not None else {}
        return {
            "ids": ids,
            "ms_per_token": seconds * 1e3,
            **{k: stats[k] for k in BREAKDOWN if k in stats},
            "budget_mb": stats["budget_bytes"] / 1e6 if stats.get("budget_bytes") else None,
        }

    keys = list(models)
    for r in range(args.rounds):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            runs.setdefault(key, []).append(run(*key))
    reference = runs[("torch", "dense", "fp16")][0]["ids"] if ("torch", "dense", "fp16") in runs else None
    rows = []
    for (engine, mode, dtype), samples in runs.items():
        device = f"mlx {mx.default_device()}" if engine == "mlx" else device_name()
        row = {
            "bench": "mlx",
            "engine": engine,
            "mode": mode,
            "dtype": dtype,
            "store": args.store,
            "device": device,
            "tokens": args.tokens,
            "rounds": len(samples),
        }
        for key in ("ms_per_token", "budget_mb", *BREAKDOWN):
            values = [s[key] for s in samples if s.get(key) is not None]
            if values:
                row[key] = statistics.median(values)
        row["same_tokens_as_torch_dense"] = None if reference is None else all(s["ids"] == reference for s in samples)
        torch_row = runs.get(("torch", mode, "fp16"))
        if engine == "mlx" and torch_row:
            row["vs_torch"] = row["ms_per_token"] / statistics.median(s["ms_per_token"] for s in torch_row)
        rows.append(row)
    for model in models.values():
        model.close()
    emit(
        rows,
        args.json,
        [
            "engine",
            "mode",
            "dtype",
            "store",
            "device",
            "budget_mb",
            "ms_per_token",
            "vs_torch",
            "io_ms",
            "mem_ms",
            "predictor_ms",
            "compute_ms",
            "bytes_per_token",
            "hit_rate",
            "same_tokens_as_torch_dense",
            "rounds",
        ],
    )
    print()
    emit(lm_head_rows(max(args.rounds, 5)), args.json)


if __name__ == "__main__":
    main()
