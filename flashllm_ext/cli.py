"""`flashllm` command line. Subcommands:

  train-predictors SOURCE   calibrate SwiGLU thresholds and train low-rank neuron predictors
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

WINDOW = 512  # tokens per forward pass while calibrating and capturing


def _ranks(text: str) -> int | list[int]:
    ranks = [int(r) for r in text.split(",")]
    if any(r <= 0 for r in ranks):
        raise argparse.ArgumentTypeError(f"ranks must be positive, got {text!r}")
    return ranks[0] if len(ranks) == 1 else ranks


def _train_predictors(args: argparse.Namespace) -> None:
    from .models import corpus_token_ids, fetch_default, load_hf_model, resolve_cache_dir, spread_windows
    from .predictor import train_predictors

    gguf_path = fetch_default() if args.source == "default" else Path(args.source)
    if not gguf_path.is_file():
        raise SystemExit(f"flashllm train-predictors: {gguf_path} is not a GGUF file (stores are not supported yet)")
    out = Path(args.out) if args.out else resolve_cache_dir() / f"{gguf_path.stem}.predictors.safetensors"
    if out.is_dir():
        out = out / "predictors.safetensors"
    model, tokenizer = load_hf_model(gguf_path)
    token_ids = spread_windows(corpus_token_ids(tokenizer, "calibration"), -(-args.tokens // WINDOW), WINDOW)
    predictors = train_predictors(model, token_ids, args.target_sparsity, args.rank, args.score, args.epochs,
                                  None if args.recall <= 0 else args.recall, args.top_k, window=WINDOW)
    predictors.save(out)
    ranks = sorted({p.rank for p in predictors.predictors})
    print(f"wrote {len(predictors.predictors)} predictors (ranks {ranks}, target sparsity {args.target_sparsity}, "
          f"score {args.score}, {token_ids.numel()} calibration tokens) to {out}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashllm", description="Run LLMs whose weights do not fit in memory.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train-predictors", help="train per-layer low-rank neuron predictors")
    train.add_argument("source", metavar="STORE_OR_CHECKPOINT",
                       help="a Llama GGUF checkpoint, or 'default' for the embedded default model")
    train.add_argument("--out", help="output file, or a directory to write predictors.safetensors into "
                                     "(default: the cache dir)")
    train.add_argument("--rank", type=_ranks, default=None,
                       help="one rank, or one per layer (comma separated); default: from each layer's density")
    train.add_argument("--target-sparsity", type=float, default=0.7)
    train.add_argument("--score", choices=("glu", "gate"), default="glu",
                       help="threshold |act(gate)*up| (glu) or |act(gate)| (gate)")
    train.add_argument("--tokens", type=int, default=4096,
                       help=f"calibration tokens (rounded up to windows of {WINDOW} spread over the calibration text)")
    train.add_argument("--epochs", type=int, default=10)
    train.add_argument("--recall", type=float, default=0.95,
                       help="per-layer probability threshold chosen for this recall (<= 0: fixed 0.5)")
    train.add_argument("--top-k", type=int, default=None, help="predict the k most likely neurons per token instead")
    train.set_defaults(run=_train_predictors)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    sys.exit(main())
