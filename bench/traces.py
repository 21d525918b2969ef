"""Real activation traces of the default model, and their tiling onto the layers of a larger model.

Benchmarks at the scale of a 7B model (bigger than the DRAM budget) run on synthesized stores with real layer
shapes; what decides their I/O and cache behaviour is which neurons fire token after token. These come from the
default model (SmolLM2-135M, 30 layers of 1536 SwiGLU neurons) on held-out English, thresholded per layer to a
target sparsity (docs/design.md §6), then tiled onto the larger layers. Benchmark support (bench_io, bench_ffn), not
library code: nothing in flashllm_ext uses it.

Two kinds of sets, on the same held-out tokens: the true sets of the one active-neuron rule (default_model_masks,
"oracle" in the benchmarks) and the sets the default model's trained predictors choose (predicted_masks).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from flashllm_ext.io.paths import resolve_cache_dir

CALIBRATION_TOKENS = 2048
CONTEXT = 512  # tokens per forward pass over one piece of held-out text
# The low-rank predictors the benchmarks drive flash reads with train on less than the CLI's 4096 tokens x 10 epochs,
# so that an operating point trains within a benchmark run on a shared 2-core machine (there ~3 min a layer at
# the CLI's settings). The scale figures were measured with these.
LOWRANK_TRAINING = ("--method", "lowrank", "--tokens", "1024", "--epochs", "2")


def predictor_training(method: str, target_sparsity: float) -> tuple[str, ...]:
    """`flashllm train-predictors` arguments of the benchmarks' `method` predictors for the true sets at threshold
    sparsity `target_sparsity`: lowrank, trained for them with LOWRANK_TRAINING; quant (W_gate and W_up at 4 bits;
    "quant:G/U": at G and U bits; codes rounded to nearest with one scale per row, as the scale figures were measured),
    at twice the true loaded density (1 - target_sparsity), calibrated on the calibration text (no training)."""
    if method == "lowrank":
        return (*LOWRANK_TRAINING, "--target-sparsity", str(target_sparsity))
    family, _, bits = method.partition(":")
    gate_bits, _, up_bits = (bits or "4/4").partition("/")
    if family == "quant" and gate_bits.isdigit() and up_bits.isdigit():
        return (
            "--method",
            "quant",
            "--gate-bits",
            gate_bits,
            "--up-bits",
            up_bits,
            "--density",
            f"{2 * (1 - target_sparsity):.4g}",
            "--rounding",
            "nearest",
            "--group-size",
            "row",
        )
    raise ValueError(f"method must be lowrank, quant or quant:G/U (gate / up bits), got {method!r}")


def trained_predictors(cache: Path, train_args: tuple[str, ...]) -> Path:
    """A predictors file of the default model built (once) by `flashllm train-predictors default *train_args`; again
    if the cached one was built before predictors kept their calibration frequencies (all zero)."""
    from flashllm_ext.predictor import load_predictors

    path = cache / f"smollm2-135m-predictors-{'-'.join(train_args[1::2])}.safetensors"
    if not path.is_file() or not load_predictors(path).frequency.any():
        for sets in path.parent.glob(f"sets-{path.stem}-*.pt"):  # the sets the old file chose (predicted_masks)
            sets.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "flashllm_ext.cli", "train-predictors", "default", "--out", str(path), *train_args],
            check=True,
            stdout=sys.stderr,
        )  # a benchmark's stdout is its --json rows
    return path


def _heldout(tokenizer, n_tokens: int, documents: int) -> tuple[torch.Tensor, int]:
    """(token ids [n_tokens], the context each forward pass sees): the first n_tokens of the held-out text
    (documents=1, contexts of CONTEXT tokens), or `documents` pieces of n_tokens / documents tokens spread evenly over
    it, each its own context (the held-out text is ~15 documents joined, so the pieces come from different ones)."""
    from flashllm_ext.hub import corpus_token_ids, spread_windows

    if documents < 1 or n_tokens % documents:
        raise ValueError(f"{n_tokens} tokens do not split into {documents} equal pieces")
    heldout = corpus_token_ids(tokenizer, "heldout")
    if heldout.numel() < n_tokens:
        raise ValueError(f"the held-out text has {heldout.numel()} tokens, fewer than the {n_tokens} asked for")
    if documents == 1:
        return heldout[:n_tokens], CONTEXT
    return spread_windows(heldout, documents, n_tokens // documents), n_tokens // documents


def _cached(path: Path, compute) -> torch.Tensor:
    if path.is_file():
        return torch.load(path)
    sets = compute()
    tmp = path.with_suffix(".tmp")
    torch.save(sets.clone(), tmp)  # clone: a slice would save its whole storage
    tmp.replace(path)
    return sets


def _docs_suffix(documents: int) -> str:
    return "" if documents == 1 else f"-{documents}docs"


def default_model_masks(
    n_tokens: int, target_sparsity: float = 0.9, progress: bool = True, documents: int = 1
) -> torch.Tensor:
    """bool [n_tokens, 30, 1536]: the default model's active FFN neurons per token of held-out text (the true sets).

    A neuron is active when |act(gate) * up| exceeds its layer's threshold, calibrated on the calibration text so
    that a fraction `target_sparsity` of scores lies below. documents > 1: the tokens are that many pieces of
    different held-out documents (see _heldout). Cached in the cache directory after the first run.
    """

    def compute() -> torch.Tensor:
        from flashllm_ext.hub import corpus_token_ids, load_hf_model, spread_windows
        from flashllm_ext.predictor import calibrate_thresholds, capture_activations

        model, tokenizer = load_hf_model()
        calibration = spread_windows(corpus_token_ids(tokenizer, "calibration"), CALIBRATION_TOKENS // 512, 512)
        thresholds = calibrate_thresholds(model, calibration, target_sparsity, progress=progress)
        ids, context = _heldout(tokenizer, n_tokens, documents)
        capture = capture_activations(model, ids, thresholds, window=context, progress=progress)
        return torch.stack([capture.mask(layer) for layer in range(len(capture.bitmaps))], dim=1)

    return _cached(
        resolve_cache_dir() / f"masks-smollm2-135m-{n_tokens}tok-sparsity{target_sparsity:g}"
        f"{_docs_suffix(documents)}.pt",
        compute,
    )


def predicted_masks(
    predictors: Path, n_tokens: int, documents: int = 1, progress: bool = False, lookahead: bool = False
) -> torch.Tensor:
    """bool [n_tokens, 30, 1536]: the sets the default model's trained predictors (a predictors file) choose on the
    same held-out tokens as default_model_masks(n_tokens, documents=documents), each layer's predictor fed the
    FFN input the dense model computes there (lookahead: the FFN's norm of the decoder layer's input instead, what
    the engine's look-ahead predicts from). Cached next to the predictors file."""
    predictors = Path(predictors)

    def compute() -> torch.Tensor:
        from flashllm_ext.hub import load_hf_model
        from flashllm_ext.predictor import capture_activations, load_predictors

        loaded = load_predictors(predictors)
        model, tokenizer = load_hf_model()
        ids, context = _heldout(tokenizer, n_tokens, documents)
        capture = capture_activations(
            model, ids, loaded.thresholds, window=context, progress=progress, lookahead=lookahead
        )
        return torch.stack([loaded.predict(i, capture.inputs[i].float()) for i in range(len(capture.inputs))], dim=1)

    name = f"sets-{predictors.stem}-{n_tokens}tok{_docs_suffix(documents)}{'-ahead' if lookahead else ''}.pt"
    return _cached(predictors.with_name(name), compute)


def tile_masks(masks: torch.Tensor, n_layers: int, n_neurons: int) -> torch.Tensor:
    """Tile masks bool [T, L0, N0] onto n_layers layers of n_neurons: bool [T, n_layers, n_neurons].

    Neuron j of large layer l takes block j // N0 from small layer (l * blocks + j // N0) % L0, so a large layer is
    a concatenation of whole small layers (each keeps its own density and token-to-token persistence) and
    consecutive large layers use different small layers. Per-neuron values [T, L0, N0] of any dtype (the
    predictors' frequencies) tile the same way with tile_layers.
    """
    if masks.dim() != 3 or masks.dtype != torch.bool:
        raise ValueError(f"masks must be bool [tokens, layers, neurons], got {masks.dtype} {tuple(masks.shape)}")
    return tile_layers(masks, n_layers, n_neurons)


def tile_layers(masks: torch.Tensor, n_layers: int, n_neurons: int) -> torch.Tensor:
    """tile_masks' tiling of any [T, L0, N0] tensor."""
    _, small_layers, small_neurons = masks.shape
    blocks = -(-n_neurons // small_neurons)
    layers = []
    for layer in range(n_layers):
        sources = [(layer * blocks + b) % small_layers for b in range(blocks)]
        layers.append(torch.cat([masks[:, s] for s in sources], dim=1)[:, :n_neurons])
    return torch.stack(layers, dim=1)


def default_model_mask_source(target_sparsity: float = 0.9, documents: int = 1):
    """A mask source for benchmarks: (n_tokens, n_layers, n_neurons) -> bool [tokens, layers, neurons], the true
    sets tiled (tile_masks: the identity on the default model's own 30 x 1536)."""

    def source(n_tokens: int, n_layers: int, n_neurons: int) -> torch.Tensor:
        return tile_masks(default_model_masks(n_tokens, target_sparsity, documents=documents), n_layers, n_neurons)

    source.__name__ = f"default_model_masks(sparsity={target_sparsity:g}, documents={documents}, tiled)"
    return source


def predicted_mask_source(predictors: Path, documents: int = 1):
    """Like default_model_mask_source, with the sets the trained predictors in the file `predictors` choose."""

    def source(n_tokens: int, n_layers: int, n_neurons: int) -> torch.Tensor:
        return tile_masks(predicted_masks(predictors, n_tokens, documents), n_layers, n_neurons)

    source.__name__ = f"predicted_masks({Path(predictors).name}, documents={documents}, tiled)"
    return source
