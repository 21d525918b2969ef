"""7B-scale flash inference: synthesized OPT-6.7B- and Llama-2-7B-shaped models decoded under a DRAM budget.

The checkpoints (bench/synth_checkpoint.py) are converted to flash stores once; each configuration runs in its own
process inside a memory cgroup of that process's baseline + the budget (bench/e2e_common.py).

The sets: the default model's active sets tiled onto the large layers (bench/e2e_replay.py), the true sets
(flash-oracle) and the sets its predictors choose, one row per predictor method, each paying for a predictor of its
method at the 7B shapes (memory charged to the budget, scoring run every token). Operating points (POINTS): (a)
OPT-like, threshold sparsity 0.97; (b) SwiGLU-real, TARGET_SPARSITY. FFN-stack rows: the FFNs decoded within the
FFN's share of --budget (of the whole model's weight bytes, the resident tensors taken first as load_flash takes
them). --full adds whole-model rows (load_flash at --budget, a prompt of --prompt-tokens held-out tokens, then
--full-tokens greedy tokens) and the accelerate peer on the same checkpoint; --full-only runs those alone;
--lookahead ahead,prefetch adds each whole-model flash row with those look-ahead modes, and each --flash-options JSON
a flash row with those keyword arguments (load_flash's in a whole-model row, ffn_stack's in an FFN-stack row: e.g.
cache_layout, window); --placement frequency each FFN-stack flash row of a trained predictor (and its
--flash-options rows) also on a copy of the store placed by the predictors' tiled frequencies (converted once; rows
say `placement`). The configurations run round-robin for --rounds rounds; the summary
rows (bench:"e2e_median") are per-configuration medians. --smoke: the checkpoints at their smoke shapes.

    python -m bench.bench_e2e_scale [--json] [--budget 50%] [--tokens 32] [--rounds 3] [--device cpu|cuda]
        [--full | --full-only] [--scale-models opt-6.7b,llama-2-7b] [--scale-layers N] [--points a,b]
        [--scale-predictors lowrank,quant,quant:4/2] [--lookahead ahead,prefetch] [--flash-options '{"window": 20}']
        [--placement frequency]
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.common import emit, median_rows, run_limited_child
from bench.e2e_common import (
    COLUMNS,
    CONFIG_FIELDS,
    KEYS,
    MODES,
    RESULTS,
    TARGET_SPARSITY,
    budget_of_first_layers,
    check_device,
    child_argv,
    child_main,
    converted_once,
    e2e_parser,
    measure_baseline,
    model_bytes_of,
    plot_breakdown,
    prompt_ids,
)
from bench.e2e_decode import run_child
from bench.e2e_replay import default_model_sets, load_replayed, run_scale_child
from bench.traces import predictor_training, trained_predictors

from flashllm_ext.io.paths import resolve_cache_dir
from flashllm_ext.predictor import DEFAULT_RECIPE

MODULE = "bench.bench_e2e_scale"  # what its children run
SCALE_COLUMNS = ["model", "operating_point", "predictor", "lookahead", *COLUMNS]
# The scale run's predictors per operating point and method: `flashllm train-predictors` arguments. At (a), those of
# bench/traces.py for the true sets at 0.97 (quant: gate and up at 4 bits, loaded density 0.06; held-out recall of
# the true sets ~0.98, BENCHMARKS.md); at (b): the library default (DEFAULT_RECIPE, spelled out so that the cached
# predictors file names it and an older default's file is not reused; the low-rank ones load 0.92 there).
SCALE_PREDICTORS = {
    "a": {method: predictor_training(method, 0.97) for method in ("lowrank", "quant")},
    "b": {
        "quant": (
            "--method",
            DEFAULT_RECIPE["method"],
            "--gate-bits",
            str(DEFAULT_RECIPE["gate_bits"]),
            "--up-bits",
            str(DEFAULT_RECIPE["up_bits"]),
            "--density",
            str(DEFAULT_RECIPE["density"]),
            "--rounding",
            DEFAULT_RECIPE["rounding"],
            "--group-size",
            str(DEFAULT_RECIPE["group_size"]),
        )
    },
}

SCALE_MODELS = ("opt-6.7b", "llama-2-7b")  # bench/synth_checkpoint.py's checkpoints, converted once
# The operating points of the scale run: (a) OPT-like, the rule's threshold sparsity 0.97 (what the paper measured for
# OPT's ReLU FFNs); (b) SwiGLU-real, TARGET_SPARSITY, where the default model's held-out perplexity stays within ~5%
# of dense. Per point: the sparsity the predictors are trained for and the one the true sets are thresholded at.
POINTS = {
    "a": ("a (OPT-like): threshold sparsity 0.97", 0.97),
    "b": (f"b (SwiGLU-real): target sparsity {TARGET_SPARSITY:g}", TARGET_SPARSITY),
}
# (mode, operating point, predictor method of SCALE_PREDICTORS)
SCALE_CONFIGS = (
    ("naive", None, None),
    ("hybrid", None, None),
    ("flash-oracle", "a", None),
    ("flash", "a", "lowrank"),
    ("flash", "a", "quant"),
    ("flash", "b", "quant"),
    ("accelerate", None, None),
)  # accelerate: --full


def scale_configs(methods: list[str]) -> list[tuple[str, str | None, str | None]]:
    """SCALE_CONFIGS with the flash rows of the predictor `methods` asked for: at point (a) a method spelled
    "quant:G/U" is a quant row at those bits (traces.predictor_training); point (b) is the default recipe's."""
    configs = []
    for mode, point, method in SCALE_CONFIGS:
        if method is None:
            configs.append((mode, point, method))
        elif point == "a":
            configs += [(mode, point, m) for m in methods if m.partition(":")[0] == method]
        elif method in methods:
            configs.append((mode, point, method))
    return configs


def scale_store(name: str, layers: int | None = None, smoke: bool = False) -> Path:
    """The flash store converted (once) from the shared synthesized checkpoint of `name` (synth_checkpoint's
    shared_checkpoint: its first `layers` layers, or its smoke shapes)."""
    from bench.synth_checkpoint import shared_checkpoint

    checkpoint = shared_checkpoint(name, layers=layers, smoke=smoke)
    return converted_once(checkpoint, checkpoint.with_name(checkpoint.name.removesuffix("-hf") + "-store"))


def placed_scale_store(store: Path, predictors: str) -> Path:
    """The checkpoint of the scale `store` converted (once) with each layer's neurons by descending calibration
    frequency of `predictors` (the default model's, tiled as their sets are): the frequency placement of
    flashllm_ext.predictor.placement at these shapes."""
    import torch

    from bench.e2e_replay import scale_frequency
    from flashllm_ext.flash.store import FlashStore
    from flashllm_ext.predictor.placement import frequency_order

    with FlashStore(store) as opened:
        frequency = scale_frequency({"predictors": predictors}, opened.n_layers, opened.n_neurons)
    stem = store.name.removesuffix("-store")
    order = torch.stack([frequency_order(layer) for layer in frequency])
    return converted_once(
        store.with_name(f"{stem}-hf"), store.with_name(f"{stem}-placed-frequency-store"), neuron_order=order
    )


def run_scale(args) -> list[dict]:
    """The scale rows: per model of --scale-models, its synthesized checkpoint converted to a store. FFN-stack rows:
    the FFNs decoded within the FFN's share of --budget (of the whole model's weight bytes, the resident tensors
    taken first as load_flash takes them). With --full, whole-model rows too: load_flash at --budget, a prompt of
    --prompt-tokens held-out tokens, then --full-tokens greedy tokens."""
    from bench.synth_checkpoint import CONFIGS as SYNTH_CONFIGS

    from flashllm_ext.runtime import parse_budget
    from flashllm_ext.flash.store import FlashStore

    cache = resolve_cache_dir() / "e2e"
    wanted = [m for m in args.modes.split(",") if m]
    configs = []
    for name in [m for m in args.scale_models.split(",") if m]:
        store = scale_store(name, args.scale_layers, args.smoke)
        shapes = ", smoke shapes" if args.smoke else ""
        shapes += f", {args.scale_layers} layers" if args.scale_layers else ""
        total = model_bytes_of(store)
        resident = model_bytes_of(store, ffn=False)
        model_budget = (
            parse_budget(args.budget, total)
            if not args.scale_layers
            else budget_of_first_layers(store, args.budget, SYNTH_CONFIGS[name]["num_hidden_layers"])
        )
        if model_budget <= resident:
            raise SystemExit(
                f"{name}: a budget of {args.budget} does not cover the {resident / 1e6:.0f} MB of resident tensors"
            )
        # Random weights: where the default model's tokenizer cannot be fetched (a lent GPU has no network), any
        # prompt does.
        ids, prompt_note = prompt_ids(args.prompt_tokens, FlashStore(store).config["vocab_size"], synthesized=True)
        baseline = measure_baseline(MODULE, args.device, store)  # this model's modules on the meta device included
        for mode, point, method in scale_configs(args.scale_predictors.split(",")):
            if mode not in wanted or (point is not None and point not in args.points.split(",")):
                continue
            label, sparsity = POINTS[point] if point else ("dense compute", None)
            train_args = (SCALE_PREDICTORS[point].get(method) or predictor_training(method, 0.97)) if method else None
            common = {
                "store": str(store),
                "mode": mode,
                "device": args.device,
                "operating_point": label,
                "sparsity": sparsity,
                "model_budget_mb": model_budget / 1e6,
                "resident_mb": resident / 1e6,
                "baseline": baseline,
                "predictor": " ".join(train_args) if method else None,
                "predictors": str(trained_predictors(cache, train_args)) if method else None,
            }
            whole = {
                **common,
                "model": f"{name} (synthesized checkpoint{shapes}, whole model)",
                "full": True,
                "budget_bytes": model_budget,
                "tokens": args.full_tokens,
                "prompt_ids": ids,
                "prompt_note": prompt_note,
                "timeout_s": args.child_timeout,
            }
            if mode == "accelerate":  # the peer runs the Hugging Face checkpoint itself: whole-model rows only
                if args.full or args.full_only:
                    from bench.synth_checkpoint import shared_checkpoint

                    hf_dir = shared_checkpoint(name, layers=args.scale_layers, smoke=args.smoke)
                    configs.append(
                        {**whole, "hf_dir": str(hf_dir), "offload_dir": str(cache / f"accelerate-offload-{name}")}
                    )
                continue
            if not args.full_only:
                stack = {
                    **common,
                    "model": f"{name} (synthesized checkpoint{shapes}, FFN stack)",
                    "budget_bytes": model_budget - resident,
                    "tokens": args.tokens,
                }
                configs.append(stack)
                if mode == "flash":
                    variants = [{**stack, "options": json.loads(options)} for options in args.flash_options]
                    if args.placement and method:
                        placed = str(placed_scale_store(store, common["predictors"]))
                        variants += [{**c, "store": placed, "placement": args.placement} for c in [stack, *variants]]
                    configs += variants
            if args.full or args.full_only:
                configs.append(whole)
                if mode == "flash":
                    configs += [{**whole, "lookahead": how} for how in args.lookahead.split(",") if how]
                    configs += [{**whole, "options": json.loads(options)} for options in args.flash_options]
    for config in configs:  # the sets, computed here: the children are limited to the budget
        if config["mode"].startswith("flash"):
            n_tokens = len(config.get("prompt_ids", ())) + config["tokens"] + 1
            chosen = default_model_sets(config, n_tokens)
            true = default_model_sets({"mode": "flash-oracle", "sparsity": config["sparsity"]}, n_tokens)
            config["recall"] = ((chosen & true).sum() / true.sum()).item()  # of the true sets, on these tokens
    rows = []
    for round_index, config in [(r, c) for r in range(args.rounds) for c in configs]:
        child_rows, facts = run_limited_child(
            child_argv(MODULE, config),
            config["budget_bytes"],
            config["baseline"],
            f"e2e-scale-{config['mode']}",
            args.child_timeout,
        )
        row = {
            "model": config["model"],
            "mode": config["mode"],
            "budget_mb": config["budget_bytes"] / 1e6,
            **(child_rows[0] if child_rows else {"error": "the child printed no row"}),
            **facts,
            "operating_point": config["operating_point"],
            "predictor": config["predictor"],
            "recall": config.get("recall"),
            "lookahead": config.get("lookahead"),
            "options": json.dumps(config["options"]) if "options" in config else None,
            "placement": config.get("placement"),
            "round": round_index,
            "budget_spec": args.budget,
            "model_budget_mb": config["model_budget_mb"],
            "resident_mb": config["resident_mb"],
            "baseline_mb": config["baseline"] / 1e6,
            "prompt_tokens": len(config.get("prompt_ids", ())),
            "prompt_note": config.get("prompt_note"),
        }
        if len(child_rows) > 1 and not row.get("error"):
            row["error"] = child_rows[-1].get("error")
        row = {**{k: row.get(k) for k in KEYS}, **row, "bench": "e2e"}
        rows.append(row)
        emit([row], args.json, SCALE_COLUMNS)
    return rows


def run_row(config: dict) -> dict:
    """A child's row: a whole-model row (run_child, the flash modes on the replayed sets) or an FFN-stack row."""
    return run_child(config, load=load_replayed) if config.get("full") else run_scale_child(config)


def main(argv: list[str] | None = None) -> None:
    parser = e2e_parser(__doc__.splitlines()[0], device=True, plot=True)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--scale-models", default=",".join(SCALE_MODELS), help="among " + ",".join(SCALE_MODELS))
    parser.add_argument(
        "--scale-layers",
        type=int,
        help="the first that many layers of each model (a checkpoint of its own, written once): a shorter run",
    )
    parser.add_argument("--points", default=",".join(POINTS), help="operating points of the flash rows")
    parser.add_argument(
        "--scale-predictors",
        default=",".join(SCALE_PREDICTORS["a"]),
        help="predictor methods of the flash rows (SCALE_PREDICTORS)",
    )
    parser.add_argument("--full", action="store_true", help="whole-model rows too (load_flash)")
    parser.add_argument(
        "--full-only",
        action="store_true",
        help="whole-model rows only (load_flash; the accelerate peer on the checkpoint)",
    )
    parser.add_argument("--full-tokens", type=int, default=4, help="--full: greedy decode tokens")
    parser.add_argument(
        "--flash-options",
        action="append",
        default=[],
        metavar="JSON",
        help="a flash row also with these keyword arguments (load_flash's / ffn_stack's), e.g. "
        '\'{"window": 20}\' or \'{"cache_layout": "hot-cold"}\' (repeatable)',
    )
    parser.add_argument(
        "--placement",
        choices=["frequency"],
        help="each FFN-stack flash row with predictors also on a copy of the store placed by their (tiled) "
        "calibration frequencies, converted once",
    )
    parser.add_argument(
        "--lookahead",
        default="",
        help="--full: each whole-model flash row also with "
        "these look-ahead modes (ahead,prefetch: load_flash(lookahead=...))",
    )
    args = parser.parse_args(argv)
    if args.child:
        child_main(args.child, run_row)
        return
    if args.quick:
        args.tokens, args.prompt_tokens, args.rounds = 4, 16, 1
    if args.smoke:  # the checkpoints' smoke shapes
        args.tokens, args.full_tokens, args.prompt_tokens = 2, 2, 4
        args.rounds, args.no_plot = 1, True
        if args.scale_predictors == parser.get_default("scale_predictors"):
            args.scale_predictors = "quant"  # calibrated, not trained: seconds
    check_device(parser, args.device)
    medians = median_rows(run_scale(args), CONFIG_FIELDS, "e2e_median")
    emit(medians, args.json, SCALE_COLUMNS)
    if not args.no_plot:
        RESULTS.mkdir(exist_ok=True)
        for model in dict.fromkeys(r["model"] for r in medians):
            plot_breakdown(
                [r for r in medians if r["model"] == model], RESULTS / f"bench_e2e_scale_{model.split()[0]}.png"
            )


if __name__ == "__main__":
    main()
