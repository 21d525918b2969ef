"""Decode and prefill speed with every weight in memory: the lean decoder (flashllm_ext.decoder) against the
transformers path (load_flash, the same fp16 store) and llama.cpp (llama-cpp-python built from source, mmap, the same
weights as an F16 GGUF), at each thread count, each system in a fresh process, interleaved over --rounds rounds.

Rows (bench:"decode", one per system, threads and round; bench:"decode_median" the medians):
  ms_per_token    the median greedy decode token after a --prompt-tokens prompt (--tokens of them)
  prefill_tok_s   a --prefill-tokens prompt's tokens per second (chunks of 256 on the lean decoder)
  baseline_mb     resident memory after the imports, before any weight: a bare interpreter importing what `flashllm
                  run` imports (lean), load_flash and the Llama modeling code (transformers), or llama.cpp's worker's
                  own figure; torch_mb: python and torch alone
  rss_mb          after loading the weights
  vs_llama_cpp    ms_per_token / llama.cpp's at the same threads (medians of the same run)
  agree           greedy tokens equal to the lean decoder's of the same round (fp16 weights: a late flip is rounding)
The lean decoder's flash modes (--modes naive,hybrid,flash at --budget, no memory limit: this measures the non-I/O
cost) add their per-token breakdown and nonio_ms, the target's numerator: the median over the decode tokens of each
token's time less its own exposed read time.

    python -m bench.bench_decode [--json] [--threads 1,2] [--rounds 3] [--tokens 32] [--prefill-tokens 512]
                                 [--modes dense,naive,hybrid,flash] [--no-llama-cpp] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench.common import arg_parser, emit, error_fields, median_rows, process_memory
from bench.e2e_common import child_argv, converted_once, default_store, prompt_ids

MODULE = "bench.bench_decode"
TOKENIZER_VOCAB = 49152  # the default model's tokenizer: llama.cpp needs one, and the scale checkpoints take it
COLUMNS = [
    "system",
    "mode",
    "threads",
    "ms_per_token",
    "vs_llama_cpp",
    "nonio_ms",
    "prefill_tok_s",
    "baseline_mb",
    "rss_mb",
    "agree",
    "error",
]


def _rss_mb() -> float:
    return process_memory()["VmRSS"] / 1e6


def _decode_times(step, first: int, n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens from `first`; step(token) -> the next token. (ids, seconds per token)."""
    ids, times, token = [first], [], first
    for _ in range(n - 1):
        start = time.perf_counter()
        token = step(token)
        times.append(time.perf_counter() - start)
        ids.append(token)
    return ids, times


# What each system's process imports before its first weight, measured in a bare interpreter (a child of this
# script has imported the benchmark's own modules too): the lean decoder's `flashllm run`, the transformers path's
# load_flash with its modeling code, and torch alone.
IMPORTS = {
    "lean": "import flashllm_ext.cli, flashllm_ext.decoder.generate, flashllm_ext.hub.tokenizer",
    "transformers": "import flashllm_ext.flash.engine, transformers.models.llama.modeling_llama",
    "torch": "import torch",
}


def imports_rss_mb(statement: str) -> float:
    """Resident MB of a fresh interpreter after `statement`."""
    import subprocess

    rss = "next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmRSS:')) * 1024 / 1e6"
    probe = f"{statement}\nprint({rss})"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=300)
    return float(done.stdout.strip().splitlines()[-1])


def run_lean(config: dict) -> dict:
    import torch

    from flashllm_ext.decoder import load_decoder

    torch.set_num_threads(config["threads"])
    mode = config["mode"]
    # The budget charges the KV cache: a flash mode sizes it for its decode only (prefill is dense's figure).
    prompt, prefill = config["prompt"], config["prefill"] if mode == "dense" else []
    decoder = load_decoder(
        config["store"],
        None if mode == "dense" else config["budget"],
        mode=mode,
        max_len=max(len(prefill), len(prompt) + config["tokens"]),
    )
    row = {"rss_mb": _rss_mb()}
    if prefill:
        start = time.perf_counter()
        decoder.prefill(prefill)
        row["prefill_tok_s"] = len(prefill) / (time.perf_counter() - start)
        decoder.reset()
    first = int(decoder.prefill(prompt).argmax())
    decoder.reset_stats()  # the breakdown then covers the decode tokens only
    counters, io_s = (None if decoder.runtime is None else decoder.runtime.counters), []

    def step(token: int) -> int:
        before = counters.io_s if counters is not None else 0.0
        token = int(decoder.forward([token]).argmax())
        io_s.append((counters.io_s if counters is not None else 0.0) - before)
        return token

    ids, times = _decode_times(step, first, config["tokens"])
    row.update(ids=ids, ms_per_token=statistics.median(times) * 1e3)
    if decoder.runtime is not None:
        s = decoder.runtime.stats()
        row.update({k: s[k] for k in ("io_ms", "mem_ms", "predictor_ms", "compute_ms", "bytes_per_token")})
        # each token less its own exposed reads: a disk that swings moves the two together, not the difference
        row["nonio_ms"] = statistics.median(t - io for t, io in zip(times, io_s)) * 1e3
    decoder.close()
    return row


def run_transformers(config: dict) -> dict:
    import torch

    from flashllm_ext.flash.engine import load_flash

    torch.set_num_threads(config["threads"])
    model = load_flash(config["store"], mode="dense")
    row = {"rss_mb": _rss_mb()}
    with torch.inference_mode():
        start = time.perf_counter()
        model(torch.tensor([config["prefill"]]))
        row["prefill_tok_s"] = len(config["prefill"]) / (time.perf_counter() - start)
        out = model(torch.tensor([config["prompt"]]), use_cache=True)
        past = out.past_key_values

        def step(token: int) -> int:
            nonlocal past
            result = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past = result.past_key_values
            return int(result.logits[0, -1].argmax())

        ids, times = _decode_times(step, int(out.logits[0, -1].argmax()), config["tokens"])
    row.update(ids=ids, ms_per_token=statistics.median(times) * 1e3)
    return row


def run_child(config: dict) -> dict:
    try:
        return (run_lean if config["system"] == "lean" else run_transformers)(config)
    except Exception as e:  # a row that says what failed, so the other systems' rows still print
        return error_fields(e)


def _run_llama_cpp(config: dict, gguf: Path) -> dict:
    """llama.cpp's row: a prefill-only run for prefill_tok_s, then the decode run (same prompt and token count)."""
    from flashllm_ext.harness.llama_cpp import run_llama_cpp

    prefill = run_llama_cpp(gguf, config["prefill"], 1, config["threads"], n_ctx=len(config["prefill"]) + 8)
    r = run_llama_cpp(gguf, config["prompt"], config["tokens"] - 1, config["threads"])
    row = {
        "ms_per_token": r.get("ms_per_token"),
        "prefill_tok_s": prefill.get("prefill_tok_s"),
        "baseline_mb": r.get("rss_baseline_mb"),
        "rss_mb": r.get("rss_load_mb"),
        "ids": r.get("generated"),
    }
    errors = [e for e in (prefill.get("error"), r.get("error")) if e]
    return {**row, **({"error": "; ".join(errors)} if errors else {})}


def _child(config: dict) -> dict:
    import subprocess

    done = subprocess.run(child_argv(MODULE, config), capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"error": f"child exited {done.returncode}: {done.stderr.strip()[-300:]}"}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> None:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--modes", default="dense", help="the lean decoder's modes (dense also runs transformers)")
    parser.add_argument("--budget", default="50%", help="the flash modes' DRAM budget (no cgroup: non-I/O cost)")
    parser.add_argument("--store", type=Path, help="a flash store (default: the default model's fp16 store)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp (it builds once, minutes)")
    parser.add_argument(
        "--scale",
        choices=["llama-2-7b"],
        help="a synthesized checkpoint of these shapes with the default tokenizer's 49152-token vocabulary, as an "
        "fp16 store and an F16 GGUF of the same weights (each written once, ~13.5 GB)",
    )
    parser.set_defaults(rounds=3)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))), flush=True)
        return
    from flashllm_ext.io.paths import resolve_cache_dir

    store, gguf, notes = args.store, None, []
    if args.smoke:
        store = _smoke_store(resolve_cache_dir() / "bench-decode-smoke")
        args.rounds, args.tokens, args.prompt_tokens, args.prefill_tokens = 1, 3, 4, 8
        args.threads = args.threads.split(",")[0]
        notes.append("smoke: a tiny random store; llama.cpp skipped (it needs its own build)")
    elif args.scale:
        store, gguf = _scale_files(args.scale)
        notes.append(f"synthesized weights with {args.scale} shapes (49152-token vocabulary)")
    elif store is None:
        store = default_store(resolve_cache_dir() / "e2e", train_predictors="flash" in args.modes)
    from flashllm_ext.flash.store import FlashStore

    with FlashStore(store) as s:
        vocab = int(s.config["vocab_size"])
    prompt, note = prompt_ids(args.prompt_tokens, vocab, synthesized=args.smoke)
    prefill, _ = prompt_ids(args.prefill_tokens, vocab, synthesized=args.smoke)
    if note:
        notes.append(note)
    if args.no_llama_cpp:
        gguf = None
    elif gguf is not None:
        from flashllm_ext.harness.llama_cpp import ensure_env

        ensure_env()
    elif not (args.smoke or args.store):
        from flashllm_ext.harness.llama_cpp import ensure_env, write_f16_gguf
        from flashllm_ext.hub import fetch_default

        ensure_env()
        source = fetch_default()
        gguf = write_f16_gguf(source, resolve_cache_dir() / "e2e" / f"{source.stem}.F16.gguf")
    systems = [("lean", m) for m in args.modes.split(",")] + (
        [("transformers", "dense")] if "dense" in args.modes else []
    )
    systems += [("llama.cpp", "dense")] if gguf is not None else []
    rows = []
    for round_ in range(args.rounds):
        for threads in [int(t) for t in args.threads.split(",")]:
            lean_ids = None
            for system, mode in systems:
                config = {
                    "system": system,
                    "mode": mode,
                    "threads": threads,
                    "store": str(store),
                    "prompt": prompt,
                    "prefill": prefill,
                    "tokens": args.tokens,
                    "budget": args.budget,
                }
                row = _run_llama_cpp(config, gguf) if system == "llama.cpp" else _child(config)
                ids = row.pop("ids", None)
                if system == "lean" and mode == "dense":
                    lean_ids = ids
                elif ids is not None and lean_ids is not None and mode == "dense":
                    row["agree"] = sum(a == b for a, b in zip(ids, lean_ids)) / len(lean_ids)
                row = {
                    "bench": "decode",
                    "system": system,
                    "mode": mode,
                    "threads": threads,
                    "round": round_,
                    "tokens": args.tokens,
                    "store": Path(store).name,
                    **row,
                }
                rows.append(row)
                if args.json:  # as soon as measured: a late failure keeps what ran
                    emit([row], True)
                else:
                    print(
                        f"round {round_}: {system} {mode} {threads} threads: {row.get('ms_per_token')} ms/token "
                        f"{row.get('error', '')}",
                        file=sys.stderr,
                        flush=True,
                    )
    medians = median_rows(rows, ("system", "mode", "threads"), "decode_median")
    baselines = {name: imports_rss_mb(statement) for name, statement in IMPORTS.items()}
    for row in medians:
        peer = next((r for r in medians if r["system"] == "llama.cpp" and r["threads"] == row["threads"]), None)
        if peer and peer.get("ms_per_token") and row.get("ms_per_token"):
            row["vs_llama_cpp"] = row["ms_per_token"] / peer["ms_per_token"]
        row.pop("round", None)
        if row["system"] in baselines:
            row.update(baseline_mb=baselines[row["system"]], torch_mb=baselines["torch"])
        if notes:
            row["note"] = "; ".join(notes)
    emit(medians, args.json, COLUMNS)


def _scale_files(name: str) -> tuple[Path, Path]:
    """(fp16 store, F16 GGUF) of the shared synthesized checkpoint `name` with the default tokenizer's vocabulary,
    each written once (bench/synth_checkpoint.py, flashllm_ext.harness.llama_cpp.write_llama_gguf)."""
    from bench.synth_checkpoint import shared_checkpoint
    from flashllm_ext.harness.llama_cpp import write_llama_gguf
    from flashllm_ext.hub import fetch_default

    tokenizer = fetch_default()
    hf = shared_checkpoint(name, vocab_size=TOKENIZER_VOCAB)
    store = converted_once(hf, hf.with_name(hf.name.removesuffix("-hf") + "-store"))
    return store, write_llama_gguf(hf, hf.with_name(hf.name.removesuffix("-hf") + ".F16.gguf"), tokenizer)


def _smoke_store(path: Path) -> Path:
    """A tiny random Llama's fp16 store (built once): seconds, no download."""
    from flashllm_ext.errors import FormatError
    from flashllm_ext.flash.convert import convert
    from flashllm_ext.flash.store import FlashStore

    try:
        FlashStore(path).close()
        return path
    except (OSError, FormatError):  # none yet, or an older format's
        pass
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    )
    hf = path.with_name(path.name + "-hf")
    LlamaForCausalLM(config).save_pretrained(hf)
    return convert(hf, path, dtype="fp16", force=True, progress=False)


if __name__ == "__main__":
    main()
