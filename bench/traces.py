"""Real activation traces of the default model, and their tiling onto the layers of a larger model.

Benchmarks at the scale of a 7B model (bigger than the DRAM budget) run on synthesized stores with real layer
shapes; what decides their I/O and cache behaviour is which neurons fire token after token. These come from the
default model (SmolLM2-135M, 30 layers of 1536 SwiGLU neurons) on held-out English, thresholded per layer to a
target sparsity (DESIGN.md §6), then tiled onto the larger layers. Benchmark support (bench_io, bench_ffn), not
library code: nothing in flashllm_ext uses it.
"""
from __future__ import annotations

import torch

from flashllm_ext.paths import resolve_cache_dir

CALIBRATION_TOKENS = 2048


def default_model_masks(n_tokens: int, target_sparsity: float = 0.9, progress: bool = True) -> torch.Tensor:
    """bool [n_tokens, 30, 1536]: the default model's active FFN neurons per token of held-out text.

    A neuron is active when |act(gate) * up| exceeds its layer's threshold, calibrated on the calibration text so
    that a fraction `target_sparsity` of scores lies below. Cached in the cache directory after the first run.
    """
    cached = resolve_cache_dir() / f"masks-smollm2-135m-{n_tokens}tok-sparsity{target_sparsity:g}.pt"
    if cached.is_file():
        return torch.load(cached)
    from flashllm_ext.models import corpus_token_ids, load_hf_model, spread_windows
    from flashllm_ext.predictor import calibrate_thresholds, capture_activations

    model, tokenizer = load_hf_model()
    calibration = spread_windows(corpus_token_ids(tokenizer, "calibration"), CALIBRATION_TOKENS // 512, 512)
    thresholds = calibrate_thresholds(model, calibration, target_sparsity, progress=progress)
    heldout = corpus_token_ids(tokenizer, "heldout", max_tokens=n_tokens)
    if heldout.numel() < n_tokens:
        raise ValueError(f"the held-out text has {heldout.numel()} tokens, fewer than the {n_tokens} asked for")
    capture = capture_activations(model, heldout, thresholds, progress=progress)
    masks = torch.stack([capture.mask(layer) for layer in range(len(capture.bitmaps))], dim=1)
    tmp = cached.with_suffix(".tmp")
    torch.save(masks, tmp)
    tmp.replace(cached)
    return masks


def tile_masks(masks: torch.Tensor, n_layers: int, n_neurons: int) -> torch.Tensor:
    """Tile masks bool [T, L0, N0] onto n_layers layers of n_neurons: bool [T, n_layers, n_neurons].

    Neuron j of large layer l takes block j // N0 from small layer (l * blocks + j // N0) % L0, so a large layer is
    a concatenation of whole small layers (each keeps its own density and token-to-token persistence) and
    consecutive large layers use different small layers.
    """
    if masks.dim() != 3 or masks.dtype != torch.bool:
        raise ValueError(f"masks must be bool [tokens, layers, neurons], got {masks.dtype} {tuple(masks.shape)}")
    _, small_layers, small_neurons = masks.shape
    blocks = -(-n_neurons // small_neurons)
    layers = []
    for layer in range(n_layers):
        sources = [(layer * blocks + b) % small_layers for b in range(blocks)]
        layers.append(torch.cat([masks[:, s] for s in sources], dim=1)[:, :n_neurons])
    return torch.stack(layers, dim=1)


def default_model_mask_source(target_sparsity: float = 0.9):
    """A mask source for benchmarks: (n_tokens, n_layers, n_neurons) -> bool [tokens, layers, neurons]."""
    def source(n_tokens: int, n_layers: int, n_neurons: int) -> torch.Tensor:
        return tile_masks(default_model_masks(n_tokens, target_sparsity), n_layers, n_neurons)

    source.__name__ = f"default_model_masks(sparsity={target_sparsity:g}, tiled)"
    return source
