"""Activation sparsity of the default model (SmolLM2-135M-Instruct) on held-out text: thresholds and predictors.

1. Threshold sweep: per-layer thresholds on the active-neuron rule's score |act(gate)*up| (flashllm_ext.predictor)
   calibrated on the calibration text for each target sparsity; held-out perplexity with the thresholded FFN patched
   in and the sparsity reached on held-out text (rows bench:"threshold").
2. Method sweep: every predictor method (--methods) built once from the calibration text, then put at
   each target loaded density (--densities, cut-offs calibrated on the calibration text only); per point one
   held-out pass with the predictor patched in (rows bench:"method"): perplexity, loaded density (mean, and the
   worst layer's distance from the target), recall of the oracle's active set at the same density and of the output
   mass, predictor memory as a fraction of the store's FFN bytes. The oracle (true sets) is the frontier. The
   patched FFN computes exactly what FlashFFN computes in flash mode (tests/flash/test_engine.py checks equal
   perplexity).
   `teal` (TEAL / R-Sparse input sparsity, flashllm_ext.predictor.teal) is measured the same way, its loaded
   density being the fraction of weight bytes read (W_gate / W_up columns of the kept input channels, W_down rows
   of the kept neurons: columns neuron_density / input_density); it needs a store read by input channel, which
   does not exist, so it has no FlashFFN row.
3. Through FlashFFN (rows bench:"flash"): per method, at its smallest swept density with perplexity <= 1.05x dense,
   the default model's fp16 store served in flash mode at a DRAM budget of --flash-budget (50%) decodes
   --decode-tokens held-out tokens one at a time: bytes read per token after the first `window` tokens, predictor
   and FFN compute ms per token, the decoded tokens' perplexity against dense decoding (with --lookahead: also with
   the engine's look-ahead). A method whose predictors leave no room in the budget gets an error row saying so.
4. Figure: perplexity vs loaded density per method with the oracle frontier, bench/results/bench_predictor.png
   for a run of the default --methods and --densities (and for --plot), else only to --figure PATH.

    python -m bench.bench_predictor [--json] [--methods quant,teal,lowrank-reg,lowrank,oracle] [--densities ...]

A --methods entry is METHOD[:G/U][+gptq][+gN][@fisher[=OTHER]]: quant's bits of W_gate / W_up, GPTQ rounding of its
codes, one scale per N columns instead of per row, and a per-layer density allocation
(flashllm_ext.predictor.allocation) computed for its own predictors or for those of the entry OTHER (e.g.
`oracle@fisher=quant:3/4+gptq`: the oracle at quant's allocation, the fair frontier of an allocated method). The
FlashFFN rows (3.) run the uniform entries only.
"""

from __future__ import annotations

import json
import math
import os
import time

import torch

from bench.common import arg_parser, emit, error_fields

from flashllm_ext.io.paths import resolve_cache_dir

from flashllm_ext.hub import corpus_token_ids, load_hf_model, perplexity, spread_windows
from flashllm_ext.predictor import (
    ALLOCATIONS,
    allocate_densities,
    calibrate_thresholds,
    capture_activations,
    operating_point,
    patched_ffn,
    predictors_from_capture,
    select_density,
)

WINDOW = 512
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEFAULT_FIGURE = os.path.join(RESULTS, "bench_predictor.png")


def threshold_sweep(model, calibration, heldout, targets, n_windows, as_json) -> None:
    rows = [
        {
            "bench": "threshold",
            "target": 0.0,
            "sparsity": 0.0,
            "ppl": perplexity(model, heldout, WINDOW, n_windows, progress=False),
        }
    ]
    for target, thresholds in calibrate_thresholds(model, calibration, targets, WINDOW).items():
        with patched_ffn(model, thresholds) as counter:
            ppl = perplexity(model, heldout, WINDOW, n_windows, progress=False)
        rows.append({"bench": "threshold", "target": target, "sparsity": counter.sparsity, "ppl": ppl})
    for row in rows:
        row["ppl_vs_dense"] = row["ppl"] / rows[0]["ppl"]
    emit(rows, as_json)


def parse_spec(spec: str) -> tuple[str, str, str | None]:
    """A --methods entry METHOD[:G/U][+gptq][@fisher[=OTHER]] -> (what is built: METHOD[:G/U][+gptq], the
    allocation, the built entry whose predictors the allocation is computed for: its own, or OTHER's)."""
    built, _, allocation = spec.partition("@")
    allocation, _, source = allocation.partition("=")
    return built, allocation or "uniform", (source or built) if allocation else None


def build_methods(model, calibration, args) -> tuple[dict, list[torch.Tensor]]:
    """Every method of --methods built once from the calibration text: ({built entry: predictors}, calibration
    inputs). An entry is a method name, with ':G/U' for quant's (or context's quant base's) bits of W_gate / W_up and
    '+gptq' for GPTQ rounding of its codes (quant.ROUNDINGS); '@fisher' (allocation.ALLOCATIONS) is applied per
    density in method_sweep, to the same built predictors."""
    thresholds = calibrate_thresholds(model, calibration, args.target_sparsity, WINDOW, progress=False)
    capture = capture_activations(model, calibration, thresholds, WINDOW, progress=False)
    built = {}
    for spec in args.methods.split(","):
        name, allocation, source = parse_spec(spec)
        if allocation not in ALLOCATIONS:
            raise SystemExit(f"{spec}: allocation must be one of {ALLOCATIONS}")
        if name in built:
            continue
        base, *options = name.split("+")
        method, _, bits = base.partition(":")
        gate_bits, up_bits = (int(b) for b in bits.split("/")) if bits else (4, 2)
        groups = [int(o[1:]) for o in options if o[:1] == "g" and o[1:].isdigit()]
        rounding = [o for o in options if not (o[:1] == "g" and o[1:].isdigit())]
        if (rounding or groups) and method not in ("quant", "context"):
            raise SystemExit(f"{spec}: +{'+'.join(options)} are options of quant's codes, {method} has none")
        if len(rounding) > 1 or len(groups) > 1:
            raise SystemExit(f"{spec}: at most one rounding and one +gN group size")
        start = time.perf_counter()
        built[name] = predictors_from_capture(
            model,
            capture,
            method,
            rank=args.rank,
            epochs=args.epochs,
            gate_bits=gate_bits,
            up_bits=up_bits,
            rounding=rounding[0] if rounding else "nearest",
            group_size=groups[0] if groups else None,
            block=args.block,
            progress=False,
        )
        built[name].build_seconds = time.perf_counter() - start
    for spec in args.methods.split(","):
        if (source := parse_spec(spec)[2]) is not None and source not in built:
            raise SystemExit(f"{spec}: allocate for {source!r}, which --methods does not build")
    return built, capture.inputs


def method_sweep(model, calibration, heldout, built, inputs, args, ffn_bytes: int) -> list[dict]:
    """Rows bench:"method" for every built method and density of --densities."""
    densities = [float(d) for d in args.densities.split(",")]
    true_thresholds = calibrate_thresholds(model, calibration, [1.0 - d for d in densities], WINDOW, progress=False)
    ppl_dense = perplexity(model, heldout, WINDOW, args.eval_windows, progress=False)
    rows, allocations = [], {}
    for spec in args.methods.split(","):
        name, allocation, source = parse_spec(spec)
        predictors = built[name]
        for density in densities:
            if allocation == "uniform":
                predictors.set_density(inputs, density)
                predictors.thresholds.zero_()
                predictors.true_thresholds.copy_(true_thresholds[1.0 - density])
                targets = [density] * predictors.n_layers
            else:  # per-layer densities calibrated for `source`'s predictors; the oracle at those same densities
                if (source, density) not in allocations:
                    start = time.perf_counter()
                    allocations[source, density] = allocate_densities(
                        model, built[source], calibration, inputs, density, allocation, progress=False
                    ).tolist()
                    built[source].allocation_seconds = time.perf_counter() - start
                targets = allocations[source, density]
                select_density(model, predictors, inputs, calibration, targets, WINDOW, progress=False)
            point = operating_point(
                model, predictors, heldout, predictors.true_thresholds, WINDOW, args.eval_windows, progress=False
            )
            layer_densities = [layer["density"] for layer in point["layers"]]
            rows.append(
                {
                    "bench": "method",
                    "method": spec,
                    "allocation": allocation,
                    "layer_targets": [round(t, 4) for t in targets],
                    "target_density": density,
                    "density": point["density"],
                    "neuron_density": point["neuron_density"],
                    "input_density": point["input_density"],
                    "max_layer_error": max(abs(d - t) for d, t in zip(layer_densities, targets)),
                    "ppl": point["ppl"],
                    "ppl_vs_dense": point["ppl"] / ppl_dense,
                    "recall": point["recall"],
                    "mass_recall": point["mass_recall"],
                    "memory_mb": predictors.memory_bytes / 1e6,
                    "memory_frac": predictors.memory_bytes / ffn_bytes,
                    "build_s": predictors.build_seconds,
                }
            )
            emit(rows[-1:], args.json)
    return rows


def flash_path(predictors, store_dir, args, lookahead: str | None = None) -> dict:
    """Decode held-out tokens one at a time with the model built from the store by load_flash (flash mode,
    --flash-budget of DRAM, fp16 resident tensors) and `predictors` (lookahead: load_flash's look-ahead, each
    token's sets chosen before attention): bytes read per token after the first window+1 tokens, predictor and
    compute time per token, and the perplexity of the decoded tokens against dense decoding of the same tokens
    (dense_decode_nll)."""
    from flashllm_ext import load_flash

    predictors.reset()
    model = load_flash(
        store_dir, args.flash_budget, mode="flash", predictors=predictors, window=args.window, lookahead=lookahead
    )
    runtime = model.flash
    try:
        nll = decode_nll(
            model, args.heldout[: args.decode_tokens], lambda t: t == args.window + 1 and runtime.counters.reset()
        )  # the window is full: what follows is the steady state
        stats = runtime.stats()
        loaded = runtime.counters.needed / max(1, runtime.counters.tokens * runtime.store.n_neurons)
    finally:
        runtime.close()
    dense = dense_decode_nll(store_dir, args)
    return {
        "bench": "flash",
        "lookahead": lookahead,
        "loaded_density": loaded,
        "bytes_per_token": stats["bytes_per_token"],
        "predictor_ms": stats["predictor_ms"],
        "compute_ms": stats["compute_ms"],
        "predictor_vs_compute": stats["predictor_ms"] / max(stats["compute_ms"], 1e-9),
        "hit_rate": stats["hit_rate"],
        "predictor_bytes": stats["predictor_bytes"],
        "tokens": stats["tokens"],
        "ppl_decode": math.exp(nll),
        "ppl_decode_vs_dense": math.exp(nll - dense),
    }


@torch.inference_mode()
def decode_nll(model, ids: torch.Tensor, before_token=lambda t: None) -> float:
    """Mean next-token NLL of ids [T] fed one token at a time through the KV cache (the path generation takes,
    where the engine's per-token work such as look-ahead runs); before_token(t) is called before token t."""
    past, total = None, 0.0
    for t in range(ids.numel() - 1):
        before_token(t)
        out = model(ids[t : t + 1].unsqueeze(0), past_key_values=past, use_cache=True)
        past = out.past_key_values
        total += torch.nn.functional.cross_entropy(out.logits[0, -1:].float(), ids[t + 1 : t + 2]).item()
    return total / (ids.numel() - 1)


def dense_decode_nll(store_dir, args) -> float:
    """decode_nll of the store's dense model (fp16, everything in memory) on the flash rows' tokens (once)."""
    if getattr(args, "dense_nll", None) is None:
        from flashllm_ext import load_flash

        args.dense_nll = decode_nll(load_flash(store_dir, None, mode="dense"), args.heldout[: args.decode_tokens])
    return args.dense_nll


def plot_methods(rows: list[dict], path: str) -> None:
    """Perplexity vs mean loaded density per method (rows bench:"method", possibly from several runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ppl_dense = rows[0]["ppl"] / rows[0]["ppl_vs_dense"]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for method in dict.fromkeys(r["method"] for r in rows):
        points = sorted((r["density"], r["ppl"]) for r in rows if r["method"] == method)
        style = dict(color="k", lw=2, marker="s") if method == "oracle" else dict(marker="o")
        ax.plot(*zip(*points), label=method + (" (frontier)" if method == "oracle" else ""), **style)
    ax.axhline(ppl_dense * 1.05, color="r", ls="--", lw=1, label="1.05 x dense")
    ax.axhline(ppl_dense, color="gray", ls=":", lw=1, label="dense")
    ax.set(
        xlabel="mean loaded density (held-out)",
        ylabel="held-out perplexity",
        yscale="log",
        title="SmolLM2-135M: predictors at target loaded densities",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--target-sparsity", type=float, default=0.6, help="the active sets lowrank learns")
    parser.add_argument("--tokens", type=int, default=4096, help="calibration/training tokens")
    parser.add_argument("--eval-windows", type=int, default=4, help=f"held-out windows of {WINDOW} tokens")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--rank", type=int, default=None, help="lowrank: from each layer's density; lowrank-reg: 96")
    parser.add_argument("--methods", default="oracle,quant:4/2,quant:4/4,quant:2/2,teal,lowrank-reg,lowrank")
    parser.add_argument("--densities", default="0.3,0.35,0.4,0.45,0.5,0.6,0.7")
    parser.add_argument("--decode-tokens", type=int, default=48, help="held-out tokens decoded through FlashFFN")
    parser.add_argument("--window", type=int, default=5, help="the neuron cache's window")
    parser.add_argument("--flash-budget", default="50%", help="the FlashFFN decode's DRAM budget (of the model)")
    parser.add_argument("--block", type=int, default=16, help="context: decoded tokens per neuron set")
    parser.add_argument("--sweep-targets", default="0.5,0.6,0.7,0.8,0.9")
    parser.add_argument("--no-sweep", action="store_true", help="skip the threshold sweep")
    parser.add_argument("--no-flash", action="store_true", help="skip the FlashFFN decode")
    parser.add_argument(
        "--lookahead",
        default="",
        help="each FlashFFN decode also with these look-ahead modes of "
        "the engine (ahead,prefetch: sets chosen before attention), perplexity against dense decoding",
    )
    parser.add_argument(
        "--flash-densities",
        default=None,
        help="only the FlashFFN decode, at these densities for every method (no method sweep)",
    )
    parser.add_argument(
        "--figure",
        default=None,
        help=f"the figure's path (default {DEFAULT_FIGURE} for --plot and "
        "for a run of the default methods and densities; other runs draw none without it, so a "
        "partial run does not replace the committed figure)",
    )
    parser.add_argument(
        "--plot",
        nargs="+",
        metavar="JSONL",
        default=None,
        help='only the figure, from the bench:"method" rows of these --json outputs',
    )
    args = parser.parse_args()
    os.makedirs(RESULTS, exist_ok=True)
    if args.smoke:  # two methods at one density on a few windows, the FlashFFN decode of a few tokens
        args.tokens, args.eval_windows, args.epochs, args.methods, args.densities = 512, 1, 1, "oracle,quant:4/4", "0.5"
        args.decode_tokens, args.no_sweep, args.figure, args.flash_budget = 4, True, None, "60%"
    full_run = not args.smoke and all(
        getattr(args, name) == parser.get_default(name) for name in ("methods", "densities")
    )
    figure = args.figure or (DEFAULT_FIGURE if args.plot or full_run else None)
    if args.plot:
        rows = [json.loads(line) for path in args.plot for line in open(path) if line.startswith("{")]
        plot_methods([r for r in rows if r.get("bench") == "method"], figure)
        print(f"figure: {figure}", flush=True)
        return

    from bench.e2e_common import default_store

    from flashllm_ext.flash.stack import store_ffn_bytes
    from flashllm_ext.flash.store import FlashStore

    model, tokenizer = load_hf_model()
    calibration = spread_windows(corpus_token_ids(tokenizer, "calibration"), -(-args.tokens // WINDOW), WINDOW)
    heldout = args.heldout = corpus_token_ids(tokenizer, "heldout")
    if not args.no_sweep:
        threshold_sweep(
            model, calibration, heldout, [float(t) for t in args.sweep_targets.split(",")], args.eval_windows, args.json
        )
    store_dir = default_store(resolve_cache_dir() / "e2e", train_predictors=False)
    with FlashStore(store_dir) as store:
        ffn_bytes = store_ffn_bytes(store)
    built, inputs = build_methods(model, calibration, args)
    if args.flash_densities:
        points = {spec: [float(d) for d in args.flash_densities.split(",")] for spec in built}
    else:
        rows = method_sweep(model, calibration, heldout, built, inputs, args, ffn_bytes)
        if figure:
            plot_methods(rows, figure)
        print(
            f"figure: {figure or 'none (not the default methods and densities; --figure PATH draws one)'}", flush=True
        )
        if args.no_flash:
            return
        points = {}  # each method at its smallest swept density within 1.05x dense perplexity
        for spec in built:
            good = [r for r in rows if r["method"] == spec and r["ppl_vs_dense"] <= 1.05]
            if good:
                points[spec] = [min(good, key=lambda r: r["density"])["target_density"]]
            else:
                emit([{"bench": "flash", "method": spec, "error": "no swept density within 1.05x dense"}], args.json)
    for spec, densities in points.items():
        if built[spec].store_layout != "bundles":
            emit(
                [
                    {
                        "bench": "flash",
                        "method": spec,
                        "error": f"needs a {built[spec].store_layout} store layout, "
                        "which is not written (evaluation only)",
                    }
                ],
                args.json,
            )
            continue
        for density in densities:
            built[spec].set_density(inputs, density)
            built[spec].thresholds.zero_()
            for lookahead in [None] + [how for how in args.lookahead.split(",") if how]:
                row = {
                    "bench": "flash",
                    "method": spec,
                    "target_density": density,
                    "memory_frac": built[spec].memory_bytes / ffn_bytes,
                }
                try:
                    row.update(flash_path(built[spec], store_dir, args, lookahead))
                except ValueError as e:  # e.g. the oracle holds every W_up / W_gate row: more than the budget
                    row.update(error_fields(e))
                emit([row], args.json)


if __name__ == "__main__":
    main()
