"""Activation sparsity of the default model (SmolLM2-135M-Instruct) on held-out text: thresholds and predictors.

1. Threshold sweep: per-layer thresholds on the active-neuron rule's score |act(gate)| (flashllm_ext.predictor)
   calibrated on the calibration text for each target sparsity; held-out perplexity with the thresholded FFN patched in and
   the sparsity reached on held-out text (rows bench:"threshold").
2. Predictors at the operating point (--target-sparsity): per-layer recall, precision, predicted (loaded)
   density, true density, false-negative mass (rows bench:"predictor"), and one bench:"predictor_ppl" line with
   held-out perplexity dense / threshold only / threshold + predictor and the FFN sparsity reached.
3. Figure: predictor output vs true activation for one layer ('LLM in a flash' Fig. 3a analogue) in
   bench/results/.

No timing: these are accuracy figures. The patched FFN computes every neuron and zeroes the inactive ones.

    python bench/bench_predictor.py [--json] [--target-sparsity 0.6] [--tokens 4096] [--no-sweep]
"""
from __future__ import annotations

import os
import time

import torch

from common import arg_parser, emit

from flashllm_ext.models import corpus_token_ids, load_hf_model, perplexity, spread_windows
from flashllm_ext.predictor import calibrate_thresholds, capture_activations, evaluate, patched_ffn, train_predictors

WINDOW = 512
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def threshold_sweep(model, calibration, heldout, targets, n_windows, as_json) -> None:
    rows = [{"bench": "threshold", "target": 0.0, "sparsity": 0.0,
             "ppl": perplexity(model, heldout, WINDOW, n_windows, progress=False)}]
    for target, thresholds in calibrate_thresholds(model, calibration, targets, WINDOW).items():
        with patched_ffn(model, thresholds) as counter:
            ppl = perplexity(model, heldout, WINDOW, n_windows, progress=False)
        rows.append({"bench": "threshold", "target": target, "sparsity": counter.sparsity, "ppl": ppl})
    for row in rows:
        row["ppl_vs_dense"] = row["ppl"] / rows[0]["ppl"]
    emit(rows, as_json)


def plot_layer(model, predictors, heldout, layer: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    capture = capture_activations(model, heldout[:WINDOW], predictors.thresholds, WINDOW,
                                  keep_scores=[layer], progress=False)
    with torch.no_grad():
        prob = torch.sigmoid(predictors.predictors[layer](capture.inputs[layer].float())).flatten()
    true = capture.scores[layer].flatten()
    pick = torch.randperm(true.numel(), generator=torch.Generator().manual_seed(0))[:20000]
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.scatter(prob[pick], true[pick], s=1, alpha=0.3)
    ax.axhline(predictors.thresholds[layer].item(), color="r", lw=1, label="activation threshold")
    ax.axvline(predictors.prob_thresholds[layer].item(), color="k", lw=1, ls="--", label="probability threshold")
    ax.set(xlabel="predictor output (probability)", ylabel="true |act(gate)|", yscale="log",
           title=f"SmolLM2-135M layer {layer}, held-out tokens")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--target-sparsity", type=float, default=0.6, help="operating point for the predictors")
    parser.add_argument("--tokens", type=int, default=4096, help="calibration/training tokens")
    parser.add_argument("--eval-windows", type=int, default=4, help=f"held-out windows of {WINDOW} tokens")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--rank", type=int, default=None, help="default: chosen from each layer's density")
    parser.add_argument("--recall", type=float, default=0.95, help="per-layer probability thresholds for this")
    parser.add_argument("--sweep-targets", default="0.5,0.6,0.7,0.8,0.9")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--plot-layer", type=int, default=15)
    args = parser.parse_args()

    model, tokenizer = load_hf_model()
    calibration = spread_windows(corpus_token_ids(tokenizer, "calibration"), -(-args.tokens // WINDOW), WINDOW)
    heldout = corpus_token_ids(tokenizer, "heldout")
    if not args.no_sweep:
        threshold_sweep(model, calibration, heldout, [float(t) for t in args.sweep_targets.split(",")],
                        args.eval_windows, args.json)

    start = time.perf_counter()
    predictors = train_predictors(model, calibration, args.target_sparsity, args.rank, args.epochs,
                                  args.recall, window=WINDOW)
    train_seconds = time.perf_counter() - start
    result = evaluate(model, predictors, heldout, WINDOW, args.eval_windows)
    emit([{"bench": "predictor", **{k: layer[k] for k in ("layer", "rank", "recall", "precision", "density",
                                                           "true_density", "fn_mass")},
           "prob_threshold": predictors.prob_thresholds[layer["layer"]].item()} for layer in result["layers"]],
         args.json)
    layers = result["layers"]
    emit([{"bench": "predictor_ppl", "target_sparsity": args.target_sparsity,
           "ppl_dense": result["ppl_dense"], "ppl_threshold": result["ppl_threshold"],
           "ppl_predictor": result["ppl_predictor"], "sparsity_threshold": result["sparsity_threshold"],
           "sparsity": result["sparsity"], "loaded_density": sum(l["density"] for l in layers) / len(layers),
           "min_recall": min(l["recall"] for l in layers),
           "max_density_ratio": max(l["density"] / l["true_density"] for l in layers),
           "train_tokens": calibration.numel(), "train_seconds": train_seconds}], args.json)

    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"predictor_layer{args.plot_layer}.png")
    plot_layer(model, predictors, heldout, args.plot_layer, path)
    print(f"figure: {path}", flush=True)


if __name__ == "__main__":
    main()
