"""End-to-end flash inference: greedy decoding of the default model from a flash store under a DRAM
budget, each mode and the accelerate disk-offload peer in its own process inside a memory cgroup of that process's
baseline + the budget (page cache counted, dropped first; bench/e2e_common.py, bench/common.py run_limited_child).

Modes: dense (reference, all in DRAM, no budget), naive, hybrid, flash (trained predictors), flash-oracle (the true
active sets of the one rule as the predictor: an upper bound), accelerate (transformers + accelerate device_map disk
offload, max_memory = the budget). Same prompt (held-out text), same number of greedy decode tokens; ms_per_token is
the median decode token after the prompt, the parts (io/mem/predictor/compute) are the engine's per-token means over
the decode tokens (stats reset after prefill); hidden_io_ms is the read time the engine overlapped with compute.
The configurations run round-robin for --rounds rounds (each in a fresh process); the summary rows
(bench:"e2e_median") are per-mode medians over the rounds, and ratios are taken between those medians.

--device cuda runs every mode on the GPU: the model and the neuron caches in GPU memory, reads staged through pinned
host memory (flashllm_ext/flash/transfer.py); the cgroup still limits host memory (its baseline includes the CUDA
context), and the budget still sizes the caches; accelerate's peer then offloads from the GPU.

--smoke: 2 tokens after a 4-token prompt, one round, no figure (the default model has no smaller shapes). The
7B-scale rows, prefill and the Endor store are benchmarks of their own: bench_e2e_scale, bench_e2e_prefill,
bench_e2e_endor.

    python -m bench.bench_e2e [--json] [--budget 50%] [--tokens 32] [--rounds 3] [--quick] [--store DIR]
                              [--store-dtype fp16|q8|q4] [--device cpu|cuda] [--modes ...] [--flash-options JSON]
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.common import emit, median_rows
from bench.e2e_common import (
    COLUMNS,
    CONFIG_FIELDS,
    DEFAULT_MODEL,
    KEYS,
    MODES,
    RESULTS,
    check_device,
    child_main,
    default_store,
    e2e_parser,
    hf_checkpoint,
    measure_baseline,
    model_bytes_of,
    plot_breakdown,
    prompt_ids,
    run_configuration,
)
from bench.e2e_decode import run_child

from flashllm_ext.io.paths import resolve_cache_dir

MODULE = "bench.bench_e2e"  # what its children run


def main(argv: list[str] | None = None) -> None:
    parser = e2e_parser(__doc__.splitlines()[0], device=True, plot=True)
    parser.add_argument(
        "--fallback-budget",
        default="75%",
        help="also run a mode at this budget when it fails in --budget (below the engine's minimum, or "
        "OOM-killed by the cgroup)",
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--store",
        help="a flash store to run instead of the default model (its predictors, if any; accelerate needs --hf-dir)",
    )
    parser.add_argument("--hf-dir", help="Hugging Face checkpoint of --store for the accelerate peer")
    parser.add_argument(
        "--store-dtype",
        default="fp16",
        choices=["fp16", "q8", "q4"],
        help="the default model's store format (convert --dtype; q4 keeps the GGUF's Q4_1 blocks of up and gate)",
    )
    parser.add_argument(
        "--flash-options",
        action="append",
        default=[],
        metavar="JSON",
        help="a flash row also with these load_flash keyword arguments, e.g. '{\"window\": 20}' or "
        '\'{"cache_layout": "per-layer"}\' (repeatable)',
    )
    args = parser.parse_args(argv)
    if args.child:
        child_main(args.child, run_child)
        return
    if args.quick:
        args.tokens, args.prompt_tokens, args.rounds = 4, 16, 1
    if args.smoke:
        args.tokens, args.prompt_tokens, args.rounds, args.no_plot = 2, 4, 1, True
    check_device(parser, args.device)
    rows = run_modes(args)
    medians = median_rows(rows, CONFIG_FIELDS, "e2e_median")
    if not args.json:
        print(f"\nmedians over {args.rounds} round(s):")
    emit(medians, args.json, COLUMNS)
    if not args.no_plot:
        RESULTS.mkdir(exist_ok=True)
        plot_breakdown(medians, RESULTS / "bench_e2e.png")


def run_modes(args) -> list[dict]:
    """The rows of --rounds rounds of every mode of --modes (and a flash row per --flash-options), round-robin, each
    in a child limited to baseline + --budget; a mode that fails there runs again at --fallback-budget."""
    from flashllm_ext.flash.store import FlashStore
    from flashllm_ext.runtime import parse_budget

    cache = resolve_cache_dir() / "e2e"
    modes = [m for m in args.modes.split(",") if m]
    flash_modes = any(m.startswith("flash") for m in modes)
    store = Path(args.store) if args.store else default_store(cache, flash_modes, args.store_dtype)
    hf_dir = (
        Path(args.hf_dir)
        if args.hf_dir
        else (hf_checkpoint(cache) if "accelerate" in modes and not args.store else None)
    )
    total = model_bytes_of(store)
    baseline = measure_baseline(MODULE, args.device, store)
    ids, prompt_note = prompt_ids(args.prompt_tokens, FlashStore(store).config["vocab_size"])
    base = {
        "model": DEFAULT_MODEL if not args.store else store.name,
        "device": args.device,
        "store": str(store),
        "tokens": args.tokens,
        "prompt_ids": ids,
        "timeout_s": args.child_timeout,
        "offload_dir": str(cache / "accelerate-offload"),
        "hf_dir": None if hf_dir is None else str(hf_dir),
        **({} if args.store else {"store_format": args.store_dtype}),
    }
    rows = []
    jobs = [(m, {}) for m in modes] + [("flash", json.loads(o)) for o in args.flash_options if "flash" in modes]
    for round_index, (mode, options) in [(r, j) for r in range(args.rounds) for j in jobs]:  # round-robin
        budgets = [None] if mode == "dense" else [parse_budget(args.budget, total)]
        while budgets:
            budget = budgets.pop(0)
            if mode == "accelerate" and hf_dir is None:
                row = {
                    "bench": "e2e",
                    "model": base["model"],
                    "mode": mode,
                    "error": "no Hugging Face checkpoint of this store (--hf-dir): the accelerate peer cannot run",
                }
            else:
                row = run_configuration(
                    MODULE, {**base, "mode": mode, "budget_bytes": budget, "options": options}, baseline
                )
            spec = (
                None
                if budget is None
                else args.budget
                if budget == parse_budget(args.budget, total)
                else args.fallback_budget
            )
            row.update(
                model_bytes_mb=total / 1e6,
                baseline_mb=baseline / 1e6,
                budget_spec=spec,
                prompt_tokens=len(ids),
                prompt_note=prompt_note,
                round=round_index,
                options=json.dumps(options) if options else None,
            )
            row = {**{k: row.get(k) for k in KEYS}, **row}
            rows.append(row)
            emit([row], args.json, COLUMNS)
            fallback = parse_budget(args.fallback_budget, total)
            if row.get("error") and budget is not None and budget < fallback:  # below the minimum, or OOM
                budgets.append(fallback)
    return rows


if __name__ == "__main__":
    main()
