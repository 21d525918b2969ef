"""Prefill in flash mode: union of the active sets vs whole layers read sequentially vs the engine's auto choice.

On the default model (flash mode, operating point (b) predictors, --budget), a prompt of --prompt-tokens held-out
tokens; each path in its own process inside a memory cgroup of that process's baseline + the budget
(bench/e2e_common.py), rounds interleaved. The auto rows use the disk profile of $FLASHLLM_DISK_PROFILE (or the
cache's disk.json), which --calibrate measures into a file of this benchmark's own. The summary rows are per-path
medians over the rounds. --budget defaults to 75%: at 50% the resident tensors and the predictors leave the FFNs less
than flash mode's minimum. --smoke: a 4-token prompt, one round, and the quant predictors of the scale run's point
(a) (calibrated: seconds) in place of the low-rank ones (trained: minutes).

    python -m bench.bench_e2e_prefill [--json] [--budget 75%] [--prompt-tokens 64] [--rounds 3] [--calibrate]
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from bench.common import emit, error_fields, run_limited_child
from bench.e2e_common import (
    DEFAULT_MODEL,
    TARGET_SPARSITY,
    child_argv,
    child_main,
    default_store,
    e2e_parser,
    measure_baseline,
    model_bytes_of,
    prompt_ids,
)
from bench.traces import LOWRANK_TRAINING, predictor_training, trained_predictors

from flashllm_ext.io.paths import resolve_cache_dir

MODULE = "bench.bench_e2e_prefill"  # what its children run
PATHS = ("union", "sequential", "auto")
PREFILL_COLUMNS = [
    "prefill",
    "round",
    "cgroup_limit_mb",
    "cgroup_peak_mb",
    "prefill_ms",
    "io_ms",
    "compute_ms",
    "bytes_read",
    "reads",
    "mean_read_kib",
    "paths",
    "error",
]


def run_prefill_child(config: dict) -> dict:
    """One prompt forward (prefill) of the default model in flash mode with the FFNs' prefill path forced or auto:
    its time and reads."""
    import flashllm_ext
    from flashllm_ext.predictor import load_predictors

    row = {
        "bench": "e2e_prefill",
        "model": DEFAULT_MODEL,
        "prefill": config["prefill"],
        "prompt_tokens": len(config["prompt_ids"]),
        "budget_mb": config["budget_bytes"] / 1e6,
    }
    try:
        model = flashllm_ext.load_flash(
            config["store"], config["budget_bytes"], mode="flash", predictors=load_predictors(config["predictors"])
        )
        for module in model.flash.modules:
            module.prefill = config["prefill"]
        with torch.inference_mode():
            start = time.perf_counter()
            model(torch.tensor([config["prompt_ids"]]), use_cache=True)
            elapsed = time.perf_counter() - start
    except Exception as e:  # the row says why
        return {**row, **error_fields(e)}
    s = model.flash.counters
    paths = {p: sum(m.prefill_paths[p] for m in model.flash.modules) for p in ("union", "sequential")}
    return {
        **row,
        "prefill_ms": elapsed * 1e3,
        "io_ms": s.io_s * 1e3,
        "compute_ms": s.compute_s * 1e3,
        "mem_ms": s.mem_s * 1e3,
        "bytes_read": s.bytes_read,
        "reads": s.n_reads,
        "mean_read_kib": s.bytes_read / max(1, s.n_reads) / 1024,
        "paths": paths,
    }


def run_prefill(args, baseline: int) -> list[dict]:
    """The rows of --rounds rounds of the prefill paths (PATHS), each in a child limited to baseline + --budget."""
    from flashllm_ext.runtime import parse_budget
    from flashllm_ext.flash.store import FlashStore

    cache = resolve_cache_dir() / "e2e"
    store = default_store(cache, train_predictors=False)
    if args.calibrate:
        import os

        from flashllm_ext.flash.calibrate import calibrate_disk

        profile = calibrate_disk(cache, save=False)
        path = cache / "prefill-disk.json"
        path.write_text(
            json.dumps({"latency_s": profile.latency_s, "bandwidth_bps": profile.bandwidth_bps, "path": profile.path})
        )
        os.environ["FLASHLLM_DISK_PROFILE"] = str(path)  # the children inherit it
    ids, _ = prompt_ids(args.prompt_tokens, FlashStore(store).config["vocab_size"])
    training = (
        predictor_training("quant", 0.97)
        if args.smoke
        else (*LOWRANK_TRAINING, "--target-sparsity", str(TARGET_SPARSITY))
    )
    base = {
        "mode": "flash",
        "store": str(store),
        "prompt_ids": ids,
        "budget_bytes": parse_budget(args.budget, model_bytes_of(store)),
        "predictors": str(trained_predictors(cache, training)),
    }
    rows = []
    for round_index, path in [(r, p) for r in range(args.rounds) for p in PATHS]:
        child_rows, facts = run_limited_child(
            child_argv(MODULE, {**base, "prefill": path}),
            base["budget_bytes"],
            baseline,
            f"e2e-prefill-{path}",
            args.child_timeout,
        )
        row = {
            "prefill": path,
            **(child_rows[0] if child_rows else {"error": "the child printed no row"}),
            **facts,
            "round": round_index,
        }
        rows.append(row)
        emit([row], args.json, PREFILL_COLUMNS)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = e2e_parser(__doc__.splitlines()[0], tokens=False)
    parser.add_argument("--calibrate", action="store_true", help="measure the disk profile auto uses")
    # 50% leaves the FFNs nothing next to the resident tensors and the predictors (flash refuses it by 0.9 MB)
    parser.set_defaults(budget="75%")
    args = parser.parse_args(argv)
    if args.child:
        child_main(args.child, run_prefill_child)
        return
    if args.quick:
        args.prompt_tokens, args.rounds = 16, 1
    if args.smoke:
        args.prompt_tokens, args.rounds = 4, 1
    # The probe builds the store's model on the meta device as every child does (~120 MB of modeling code).
    rows = run_prefill(args, measure_baseline(MODULE, store=default_store(resolve_cache_dir() / "e2e", False)))
    if not args.json:
        print("\nmedians:")
    emit(
        [
            {
                "prefill": p,
                **{
                    k: statistics.median(r[k] for r in rows if r["prefill"] == p and not r.get("error"))
                    for k in ("prefill_ms", "io_ms", "compute_ms", "bytes_read", "reads", "mean_read_kib")
                },
            }
            for p in PATHS
            if any(r["prefill"] == p and not r.get("error") for r in rows)
        ],
        args.json,
        PREFILL_COLUMNS,
    )


if __name__ == "__main__":
    main()
