"""Decode speed against total process memory: the lean decoder's modes on a quantized store (what `flashllm run`
serves) and llama.cpp (llama-cpp-python, mmap, with and without its weight repacking) on the user's GGUF, each process
in a memory cgroup of its own baseline + a share of the GGUF file's bytes (page cache counted, dropped first).

"Faster than llama.cpp" means at the same total memory: every system runs at every --memory level, the limit being
that system's baseline (its imports, measured as the peak of a probe process's cgroup, the same way for both) + the
level's bytes; our engine also gets the level's bytes as its DRAM budget. A point where a system cannot run (its
engine refuses the budget, or the cgroup OOM-kills it) is a row with `error`, drawn as a cross on the figure.

--scale llama-3-8b: a Llama-3-8B-shaped Q4_0 GGUF of synthesized weights (bench/synth_checkpoint.py, written once,
4.5 GB) and its q4 store (converted once); the lean decoder's flash rows there are flash-oracle: the default model's
true sets at the SwiGLU-real operating point (threshold sparsity TARGET_SPARSITY) tiled onto the large layers and
replayed (bench/e2e_replay.py), with no predictor to pay for: an upper bound of flash at these shapes.
--scale llama-2-7b: the synthesized Llama-2-7B checkpoint bench_e2e_scale decodes (13.5 GB, written once), its fp16
store and an F16 GGUF of the same weights with a placeholder vocabulary (llama.cpp's peer, written once); with
--modes ...,flash the flash row replays the sets the default model's predictors choose (SwiGLU-real, the default
recipe), tiled, and pays for a predictor of their method at these shapes (memory and scoring), as bench_e2e_scale's.

Rows (bench:"memory", one per system, level and round; bench:"memory_median" the medians over --rounds, round-robin,
each round starting one system later than the one before, `position` the row's place in its round):
  system, mode      lean naive | hybrid | flash, or llama.cpp mmap (repack on or off)
  memory_pct        the level, a share of the GGUF file's bytes; limit_mb = baseline_mb + the level's bytes
  ms_per_token      median greedy decode token after a --prompt-tokens prompt of held-out text
  read_mb_per_token storage bytes read per decode token (the engine's counters; llama.cpp: /proc/self/io)
  peak_mb           the cgroup's peak (page cache counted)
  vs_llama_cpp      ms_per_token / the faster llama.cpp row's at the same level (medians)
  agree             leading greedy tokens equal to llama.cpp's (no repack) of the same round, as a share
Figure (not with --smoke or --no-plot): bench/results/bench_memory_smollm2_<format>.png (--scale:
bench_memory_<name>_<format>.png), ms/token
against limit_mb.

    python -m bench.bench_memory [--json] [--memory 30%,50%,75%,100%,150%] [--modes naive,hybrid,flash]
                                 [--format q4] [--tokens 16] [--rounds 3] [--no-llama-cpp] [--smoke]
                                 [--scale llama-3-8b | llama-2-7b]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.common import arg_parser, emit, median_rows

RESULTS = Path(__file__).resolve().parent / "results"
COLUMNS = [
    "system",
    "mode",
    "memory_pct",
    "limit_mb",
    "ms_per_token",
    "vs_llama_cpp",
    "read_mb_per_token",
    "hit_rate",
    "peak_mb",
    "agree",
    "error",
]
MODULE = "bench.bench_memory"  # what its children run


def run_child(config: dict) -> dict:
    """One lean-decoder mode in this process (a child): load within the budget, greedy-decode, the row. The probe
    stops after the imports every child of this configuration makes (its baseline)."""
    import statistics
    import time

    from flashllm_ext.decoder import load_decoder

    # at scale the flash rows replay the default model's tiled sets: the true ones (flash-oracle), or its predictors'
    # with a predictor of their method at these shapes to pay for (flash with config["predictors"])
    mode, _, layout = config["mode"].partition(":")  # flash:<cache layout>
    replay = mode == "flash-oracle" or bool(config.get("predictors"))
    if replay:
        from bench.e2e_replay import replayed_predictors
        from flashllm_ext.flash.store import FlashStore
    if config.get("probe"):
        return {}
    prompt, tokens, at, predictors = config["prompt"], config["tokens"], [0], None
    if replay:  # the sets of the token at position at[0] and after: the prompt's at 0, then one per decode step
        with FlashStore(config["store"]) as store:
            predictors = replayed_predictors(config, store, at, len(prompt))
    decoder = load_decoder(
        config["store"],
        config["budget_bytes"],
        mode="flash" if replay else mode,
        predictors=predictors,
        cache_layout=layout or "auto",
        window=5,
        max_len=len(prompt) + tokens,
    )
    token = int(decoder.prefill(prompt).argmax())
    decoder.reset_stats()  # the counters then cover the decode tokens only
    ids, times = [token], []
    for step in range(tokens - 1):
        at[0] = len(prompt) + step
        start = time.perf_counter()
        token = int(decoder.forward([token]).argmax())
        times.append(time.perf_counter() - start)
        ids.append(token)
    stats = decoder.stats()
    decoder.close()
    return {
        "ms_per_token": statistics.median(times) * 1e3,
        "read_mb_per_token": stats["bytes_per_token"] / 1e6,
        "reads_per_token": stats["reads_per_token"],
        "hit_rate": stats["hit_rate"],
        "io_ms": stats["io_ms"],
        "ids": ids,
    }


def run_lean(config: dict, limit: int, timeout: float) -> dict:
    """One lean-decoder mode (config: run_child's) in a child limited to `limit` bytes."""
    from bench.e2e_common import child_argv
    from flashllm_ext.harness.cgroup import run_limited_child

    rows, facts = run_limited_child(child_argv(MODULE, config), limit, 0, f"memory-{config['mode']}", timeout)
    out = rows[-1] if rows else {"error": "the child printed no row"}
    if "error" in out:  # a refused budget ends the child with a traceback: its last line says why
        out["error"] = out["error"].strip().splitlines()[-1][-300:]
    error = "OOM-killed" if facts["oom_killed"] else out.get("error")
    return {
        **out,
        "peak_mb": facts["cgroup_peak_mb"],
        "oom_killed": facts["oom_killed"],
        **({"error": error} if error else {}),
    }


def run_llama(
    gguf: Path, repack: bool, limit: int, prompt: list[int], tokens: int, threads: int, timeout: float
) -> dict:
    from flashllm_ext.harness.llama_cpp import run_llama_cpp

    r = run_llama_cpp(gguf, prompt, tokens - 1, threads, repack=repack, memory_limit_bytes=limit, timeout=timeout)
    error = "OOM-killed" if r.get("oom_killed") else r.get("error")
    return {
        "ms_per_token": r.get("ms_per_token"),
        "read_mb_per_token": r.get("proc_read_mb_per_token"),
        "ids": r.get("generated"),
        "peak_mb": r.get("cgroup_peak_mb"),
        "oom_killed": r.get("oom_killed"),
        **({"error": error} if error else {}),
    }


def plot(medians: list[dict], failed: list[dict], path: Path) -> None:
    """ms/token against total process memory, a line per system; the levels where a system could not run as
    crosses on the figure's top edge."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    systems = sorted({(r["system"], r["mode"]) for r in medians + failed})
    top = max((r["ms_per_token"] for r in medians), default=1.0) * 1.5
    for system, mode in systems:
        ok = sorted((r for r in medians if (r["system"], r["mode"]) == (system, mode)), key=lambda r: r["limit_mb"])
        (line,) = ax.plot([r["limit_mb"] for r in ok], [r["ms_per_token"] for r in ok], "o-", label=f"{system} {mode}")
        bad = [r["limit_mb"] for r in failed if (r["system"], r["mode"]) == (system, mode)]
        ax.plot(bad, [top] * len(bad), "x", color=line.get_color(), markersize=9)
    ax.set_yscale("log")
    ax.set_xlabel("total process memory (cgroup limit, MB)")
    ax.set_ylabel("ms per token (median)")
    ax.set_title("decode speed at the same total memory (x: could not run)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def model_files(args) -> tuple[Path, Path, list[str]]:
    """(GGUF, its store in --format, notes): the default model's (the demo's stores, with their predictors), or the
    synthesized --scale checkpoint's, each written once."""
    from flashllm_ext.hub import fetch_default, resolve_cache_dir

    if not args.scale:
        from flashllm_ext.demos.flash import prepare_store

        gguf = fetch_default()
        return gguf, prepare_store(gguf, resolve_cache_dir(), args.format), []
    from bench.e2e_common import converted_once
    from bench.synth_checkpoint import shared_gguf

    if args.scale == "llama-2-7b":  # the checkpoint bench_e2e_scale decodes, its fp16 store and an F16 GGUF of it
        from bench.bench_e2e_scale import scale_store
        from bench.synth_checkpoint import placeholder_tokenizer_gguf, shared_checkpoint
        from flashllm_ext.flash.store import FlashStore
        from flashllm_ext.harness.llama_cpp import write_llama_gguf

        store = scale_store(args.scale)
        with FlashStore(store) as opened:
            tokenizer = placeholder_tokenizer_gguf(int(opened.config["vocab_size"]))
        checkpoint = shared_checkpoint(args.scale)
        gguf = write_llama_gguf(checkpoint, checkpoint.with_name(f"{args.scale}.F16.gguf"), tokenizer)
        return gguf, store, [f"synthesized weights with {args.scale} shapes (fp16 store, F16 GGUF)"]
    gguf = shared_gguf(args.scale, "q4_0")
    store = converted_once(gguf, gguf.with_name(f"{args.scale}-{args.format}-store"), args.format)
    return gguf, store, [f"synthesized weights with {args.scale} shapes (Q4_0)"]


def main(argv: list[str] | None = None) -> None:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--memory", default="30%,50%,75%,100%,150%", help="levels: shares of the GGUF file's bytes")
    parser.add_argument(
        "--modes",
        default=None,
        help="the lean decoder's modes (default naive,hybrid,flash; with --scale naive,hybrid,flash-oracle); "
        "flash:<layout> a flash row with that cache_layout (shared, per-layer, hot-cold; flash: auto's)",
    )
    parser.add_argument(
        "--format", choices=["fp16", "q8", "q4"], help="the store's format (default q4; fp16 with --scale llama-2-7b)"
    )
    parser.add_argument(
        "--scale",
        choices=["llama-3-8b", "llama-2-7b"],
        help="a synthesized model of these shapes instead: llama-3-8b a Q4_0 GGUF, llama-2-7b an fp16 checkpoint",
    )
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (ours: torch's default)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp (it builds once, minutes)")
    parser.add_argument(
        "--llama-cpp",
        default="no repack,repack",
        help="llama.cpp's variants: its weight repacking off (mmap only) and on (copies into anonymous memory)",
    )
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--timeout",
        type=float,
        default=1800,
        help="seconds a process may run (one that thrashes is killed: an error row)",
    )
    parser.set_defaults(rounds=3)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))), flush=True)
        return
    args.modes = args.modes or ("naive,hybrid,flash-oracle" if args.scale else "naive,hybrid,flash")
    if args.scale == "llama-2-7b" and args.format not in (None, "fp16"):
        parser.error("--scale llama-2-7b is an fp16 checkpoint: its store is fp16")
    args.format = args.format or ("fp16" if args.scale == "llama-2-7b" else "q4")
    if args.smoke:
        args.memory, args.modes, args.tokens, args.prompt_tokens, args.rounds = "150%", "naive", 3, 4, 1
        args.no_llama_cpp, args.no_plot, args.scale = True, True, None

    from bench.e2e_common import TARGET_SPARSITY, child_argv, probe_peak_bytes, prompt_ids
    from flashllm_ext.flash.store import FlashStore
    from flashllm_ext.runtime import parse_budget

    gguf, store, notes = model_files(args)
    file_bytes = gguf.stat().st_size
    with FlashStore(store) as opened:
        prompt, _ = prompt_ids(args.prompt_tokens, int(opened.config["vocab_size"]), synthesized=bool(args.scale))
    modes = args.modes.split(",")
    base = {"store": str(store), "prompt": prompt, "tokens": args.tokens, "sparsity": TARGET_SPARSITY}
    lean = {mode: {**base, "mode": mode} for mode in modes}
    flash_modes = [mode for mode in modes if mode.partition(":")[0] == "flash"]
    if args.scale and flash_modes:  # the default model's predictors: their sets tiled, one of their size paid
        from bench.bench_e2e_scale import SCALE_PREDICTORS
        from bench.traces import trained_predictors
        from flashllm_ext.io.paths import resolve_cache_dir

        predictors = trained_predictors(resolve_cache_dir() / "e2e", SCALE_PREDICTORS["b"]["quant"])
        for mode in flash_modes:
            lean[mode]["predictors"] = str(predictors)
    for config in lean.values():  # the parent computes (and caches) the default model's sets: no child has room
        if config["mode"] == "flash-oracle" or "predictors" in config:
            from bench.e2e_replay import default_model_sets

            default_model_sets(config, len(prompt) + args.tokens + 1)
    levels = [(spec, parse_budget(spec, file_bytes)) for spec in args.memory.split(",")]
    systems = [("lean", mode) for mode in modes]
    probe = {**lean[modes[-1]], "probe": True}  # the imports of the heaviest child (a flash row's replay)
    baselines = {"lean": probe_peak_bytes(child_argv(MODULE, probe), "memory-probe")}
    if args.smoke:
        print("smoke: llama.cpp skipped (it needs its own build)", file=sys.stderr)
    elif not args.no_llama_cpp:
        from flashllm_ext.harness.llama_cpp import WORKER, env_python, ensure_env

        baselines["llama.cpp"] = probe_peak_bytes(
            [str(env_python(ensure_env())), "-I", str(WORKER), "--baseline"], "llama-probe"
        )
        peers = [("llama.cpp", f"mmap, {how}") for how in args.llama_cpp.split(",")]
        systems = [*sorted(peers), *systems]
    rows = []
    for round_ in range(args.rounds):
        # each round starts one system later: a position in the round costs time of its own (a row's process runs
        # after another's teardown), which rotating spreads over every system
        order = systems[round_ % len(systems) :] + systems[: round_ % len(systems)]
        for spec, level in levels:
            ran = []
            for position, (system, mode) in enumerate(order):
                limit = baselines[system] + level
                if system == "lean":
                    row = run_lean({**lean[mode], "budget_bytes": level}, limit, args.timeout)
                else:
                    repack = mode.endswith(" repack")
                    row = run_llama(gguf, repack, limit, prompt, args.tokens, args.threads, args.timeout)
                ran.append((system, mode, position, row))
            reference = next((r.get("ids") for _, mode, _, r in ran if mode == "mmap, no repack"), None)
            for system, mode, position, row in ran:
                ids = row.pop("ids", None)
                if ids and reference and mode != "mmap, no repack":
                    same = next((i for i, (a, b) in enumerate(zip(ids, reference)) if a != b), len(reference))
                    row["agree"] = same / len(reference)
                row = {
                    "bench": "memory",
                    "system": system,
                    "mode": mode,
                    "model": args.scale or "SmolLM2-135M-Instruct",
                    "format": args.format if system == "lean" else gguf.name,
                    "memory_pct": spec,
                    "level_mb": level / 1e6,
                    "baseline_mb": baselines[system] / 1e6,
                    "limit_mb": (baselines[system] + level) / 1e6,
                    "file_mb": file_bytes / 1e6,
                    "tokens": args.tokens,
                    "round": round_,
                    "position": position,
                    **row,
                }
                rows.append(row)
                emit([row], args.json, COLUMNS)
    medians = median_rows(rows, ("system", "mode", "memory_pct"), "memory_median")
    for row in medians:
        peers = [
            r["ms_per_token"] for r in medians if r["system"] == "llama.cpp" and r["memory_pct"] == row["memory_pct"]
        ]
        if peers and row.get("ms_per_token"):
            row["vs_llama_cpp"] = row["ms_per_token"] / min(peers)
        row.pop("round", None), row.pop("position", None)
        if notes:
            row["note"] = "; ".join(notes)
    ran = {(m["system"], m["mode"], m["memory_pct"]) for m in medians}
    failed = [r for r in rows if r.get("error") and (r["system"], r["mode"], r["memory_pct"]) not in ran]
    if not args.json:
        print(f"\nmedians over {args.rounds} round(s):")
    emit(medians, args.json, COLUMNS)
    if not args.no_plot and medians:
        RESULTS.mkdir(exist_ok=True)
        figure = RESULTS / f"bench_memory_{args.scale or 'smollm2'}_{args.format}.png"
        plot(medians, failed, figure)
        print(f"figure: {figure}", file=sys.stderr)


if __name__ == "__main__":
    main()
