"""The Endor flash store end to end: flash mode on the Wanda-50%-pruned default model's dense and Endor stores.

Two stores of the same pruned model, dense bundles and Endor rows (store_format "dense" / "endor"), same budget,
prompt and tokens, each in its own process inside a memory cgroup of that process's baseline + the budget
(bench/e2e_common.py), interleaved: bytes read per token and ms/token of the Endor store against the dense one. Both
run flash-oracle (the true active sets of the rule, thresholds calibrated on the pruned model at TARGET_SPARSITY): the
same sets on both stores, so the comparison is of the formats alone, with no predictor to train. The summary rows
(bench:"e2e_median") are per-format medians over the rounds, and bench:"e2e_endor_ratio" the Endor store's against
the dense one's. --smoke: 2 tokens after a 4-token prompt, one round.

    python -m bench.bench_e2e_endor [--json] [--budget 50%] [--tokens 32] [--rounds 3] [--max-gap BYTES] [--no-limit]
"""

from __future__ import annotations

from pathlib import Path

import torch

from bench.common import emit, median_rows
from bench.e2e_common import (
    COLUMNS,
    CONFIG_FIELDS,
    DEFAULT_MODEL,
    KEYS,
    TARGET_SPARSITY,
    child_main,
    e2e_parser,
    hf_checkpoint,
    measure_baseline,
    model_bytes_of,
    prompt_ids,
    run_configuration,
)
from bench.e2e_decode import run_child

from flashllm_ext.errors import FormatError
from flashllm_ext.io.paths import resolve_cache_dir

MODULE = "bench.bench_e2e_endor"  # what its children run
ENDOR_COLUMNS = ["store_format", "decompress_ms", "requested_bytes_per_token"] + COLUMNS


def endor_stores(cache: Path) -> tuple[dict[str, Path], list[float]]:
    """(store_format -> fp16 store of the Wanda-50%-pruned default model, the pruned model's per-layer thresholds at
    TARGET_SPARSITY on the calibration text); all cached."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flashllm_ext.flash.convert import convert
    from flashllm_ext.hub import corpus_token_ids
    from flashllm_ext.predictor import calibrate_thresholds
    from flashllm_ext.flash.store import FlashStore

    checkpoint = hf_checkpoint(cache, wanda_sparsity=0.5)
    stores = {}
    for fmt in ("dense", "endor"):
        path = cache / f"smollm2-135m-wanda50-{fmt}-fp16"
        try:
            FlashStore(path)
        except (OSError, FormatError):  # none yet, or written by an older format: (re)convert
            convert(checkpoint, path, dtype="fp16", endor=fmt == "endor", force=True)
        stores[fmt] = path
    cached = cache / f"smollm2-135m-wanda50-thresholds-{TARGET_SPARSITY:g}.pt"
    if not cached.is_file():
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        ids = corpus_token_ids(AutoTokenizer.from_pretrained(checkpoint), "calibration", max_tokens=2048)
        torch.save(calibrate_thresholds(model, ids, TARGET_SPARSITY), cached)
    return stores, torch.load(cached).tolist()


def run_endor(args, cache: Path) -> list[dict]:
    """Flash mode (true active sets) on the dense and the Endor store of the pruned model, round-robin, each in its
    own process."""
    from flashllm_ext.runtime import parse_budget
    from flashllm_ext.flash.store import FlashStore

    stores, thresholds = endor_stores(cache)
    baseline = measure_baseline(MODULE, store=stores["dense"])  # the same model class for both
    total = model_bytes_of(stores["dense"])  # the same for both: an Endor model decompresses to the same bundles
    budget = parse_budget(args.budget, total)
    ids, prompt_note = prompt_ids(args.prompt_tokens, FlashStore(stores["dense"]).config["vocab_size"])
    rows = []
    for round_index, fmt in [(r, f) for r in range(args.rounds) for f in stores]:
        config = {
            "model": f"{DEFAULT_MODEL} Wanda 50%",
            "store": str(stores[fmt]),
            "store_format": fmt,
            "mode": "flash-oracle",
            "thresholds": thresholds,
            "budget_bytes": budget,
            "tokens": args.tokens,
            "prompt_ids": ids,
            "timeout_s": args.child_timeout,
            "reader_options": None if args.max_gap is None else {"max_gap": args.max_gap, "min_read": 0},
        }
        row = run_configuration(MODULE, config, None if args.no_limit else baseline)
        if args.no_limit:
            row["cgroup_note"] = "--no-limit: the engine's budget applies, the cgroup only measures the peak"
        row.update(
            model_bytes_mb=total / 1e6,
            baseline_mb=baseline / 1e6,
            budget_spec=args.budget,
            prompt_tokens=len(ids),
            prompt_note=prompt_note,
            round=round_index,
            store_format=fmt,
            max_gap=args.max_gap,
        )
        row = {**{k: row.get(k) for k in KEYS}, **row}
        rows.append(row)
        emit([row], args.json, ENDOR_COLUMNS)
    medians = median_rows(rows, CONFIG_FIELDS, "e2e_median")
    by_format = {m["store_format"]: m for m in medians}
    if set(by_format) == {"dense", "endor"}:
        dense, comp = by_format["dense"], by_format["endor"]
        same = [r["generated"] for r in rows if r.get("generated")]
        medians.append(
            {
                "bench": "e2e_endor_ratio",
                "model": dense["model"],
                "budget_mb": budget / 1e6,
                "bytes_per_token_ratio": comp["bytes_per_token"] / dense["bytes_per_token"],
                "requested_bytes_ratio": comp["requested_bytes_per_token"] / dense["requested_bytes_per_token"],
                "ms_per_token_ratio": comp["ms_per_token"] / dense["ms_per_token"],
                "same_tokens": all(g == same[0] for g in same),
                "rounds": args.rounds,
            }
        )
    return medians


def main(argv: list[str] | None = None) -> None:
    parser = e2e_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--max-gap",
        type=int,
        help="the reader's coalescing gap in bytes, with no minimum read size (default: the reader's defaults)",
    )
    parser.add_argument(
        "--no-limit",
        action="store_true",
        help="measure each child's cgroup peak without enforcing baseline + budget",
    )
    args = parser.parse_args(argv)
    if args.child:
        child_main(args.child, run_child)
        return
    if args.quick:
        args.tokens, args.prompt_tokens, args.rounds = 4, 16, 1
    if args.smoke:
        args.tokens, args.prompt_tokens, args.rounds = 2, 4, 1
    medians = run_endor(args, resolve_cache_dir() / "e2e")
    if not args.json:
        print(f"\nmedians over {args.rounds} round(s):")
    emit(
        medians,
        args.json,
        ["bytes_per_token_ratio", "requested_bytes_ratio", "ms_per_token_ratio", "same_tokens"] + ENDOR_COLUMNS,
    )


if __name__ == "__main__":
    main()
