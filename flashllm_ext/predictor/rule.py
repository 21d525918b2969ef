"""Activation sparsity on real models: capture, per-layer thresholds (SwiGLU) and low-rank neuron predictors.

The one active-neuron rule (shared by calibration, training, `evaluate`, FlashFFN and the sparse_ffn kernel),
per FFN layer with n neurons:
  input   x [T, d]: what the FFN itself receives (after its norm: Llama's post_attention_layernorm, OPT's
          final_layer_norm); the predictor sees exactly this.
  score   |h|: h = act(x . gate + b) * (x . up) for GLU models (SwiGLU), act(x . up + b) otherwise (OPT's
          relu(fc1(x))): what the down projection multiplies, and what sparse_ffn thresholds. (|act(gate)| alone,
          CATS' score, costs far more perplexity at the same sparsity: BENCHMARKS.md.)
  active  score > the layer's threshold (strictly: ties are inactive, as in every kernel). ReLU models have exact
          zeros, so threshold 0 gives their natural sparsity; SwiGLU has none, so the threshold is calibrated to a
          target sparsity.
A predictor guesses the active set from x. The patched FFN used for perplexity computes h = act(gate) * up
densely, then zeroes the inactive neurons: it measures accuracy, not speed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from flashllm_ext.ops import ACTIVATIONS, config_activation
from flashllm_ext.hub.hf import decoder_layers


@dataclass
class FFNModules:
    """The modules of one FFN layer the hooks attach to."""

    ffn_input: nn.Module  # its (first) input is x, the FFN's own input
    down: nn.Module  # its input is h


def ffn_modules(model: nn.Module) -> list[FFNModules]:
    """Per-layer FFN modules of a Hugging Face Llama-family or OPT causal LM."""
    layers = decoder_layers(model)
    if layers and hasattr(layers[0], "mlp") and hasattr(layers[0].mlp, "gate_proj"):
        return [FFNModules(layer.mlp, layer.mlp.down_proj) for layer in layers]
    if layers and hasattr(layers[0], "fc2"):
        return [FFNModules(layer.fc1, layer.fc2) for layer in layers]
    raise ValueError(f"{type(model).__name__}: not a Llama-family (mlp.gate_proj) or OPT (fc1/fc2) causal LM")


@dataclass
class FFNWeights:
    """One FFN layer's input projections as the model computes h (float32 copies): act(x . gate + gate_bias) *
    (x . up + up_bias) for GLU layers (gate not None), act(x . up + up_bias) otherwise (biases None if absent)."""

    gate: torch.Tensor | None  # [n, d]
    gate_bias: torch.Tensor | None  # [n]
    up: torch.Tensor  # [n, d]
    up_bias: torch.Tensor | None  # [n]

    def h(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """float32 [T, n]: what the down projection multiplies, for x [T, d] (as the model computes it)."""
        act = ACTIVATIONS[activation].fn
        up = F.linear(x.float(), self.up, self.up_bias)
        return act(up) if self.gate is None else act(F.linear(x.float(), self.gate, self.gate_bias)) * up


def ffn_weights(model: nn.Module) -> tuple[list[FFNWeights], str]:
    """Per-layer input projections of a Llama-family or OPT model and the name of its activation (a key of
    flashllm_ext.ops.ACTIVATIONS)."""
    config = model.config
    activation = config_activation(config.to_dict())

    def copy(linear: nn.Module, part: str) -> torch.Tensor | None:
        t = getattr(linear, part, None)
        return None if t is None else t.detach().float().clone()

    out = []
    for layer in decoder_layers(model):
        if hasattr(layer, "mlp") and hasattr(layer.mlp, "gate_proj"):
            mlp = layer.mlp
            out.append(
                FFNWeights(
                    copy(mlp.gate_proj, "weight"),
                    copy(mlp.gate_proj, "bias"),
                    copy(mlp.up_proj, "weight"),
                    copy(mlp.up_proj, "bias"),
                )
            )
        else:
            out.append(FFNWeights(None, None, copy(layer.fc1, "weight"), copy(layer.fc1, "bias")))
    return out, activation


def input_weight_share(model: nn.Module) -> float:
    """The share of an FFN layer's weights in its input projections: 2/3 for a GLU (W_gate and W_up against
    W_down), 1/2 otherwise (OPT's fc1 against fc2); biases aside."""
    return 2.0 / 3.0 if hasattr(ffn_modules(model)[0].ffn_input, "gate_proj") else 0.5


def activation_score(h: torch.Tensor) -> torch.Tensor:
    """The rule's score [N, n] of the activations h [N, n] the down projection multiplies: |h|."""
    return h.abs()


# Callback of `ffn_hooks`: (layer, x [N, d], h [N, n]) -> replacement h or None.
FFNCallback = Callable[[int, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


@contextmanager
def ffn_hooks(model: nn.Module, callback: FFNCallback) -> Iterator[list[FFNModules]]:
    """Calls `callback` at every FFN layer's down projection during forward passes; a returned tensor replaces
    the down projection's input. Hooks are removed on exit, even on error."""
    modules = ffn_modules(model)
    stash: dict[tuple[str, int], torch.Tensor] = {}
    handles = []

    def keep_x(i: int):
        return lambda module, args: stash.__setitem__(("x", i), args[0])

    def at_down(i: int):
        def hook(module, args):
            h = args[0]
            x = stash.pop(("x", i))
            flat = callback(i, x.reshape(-1, x.shape[-1]), h.reshape(-1, h.shape[-1]))
            return None if flat is None else (flat.view_as(h),)

        return hook

    try:
        for i, m in enumerate(modules):
            handles.append(m.ffn_input.register_forward_pre_hook(keep_x(i)))
            handles.append(m.down.register_forward_pre_hook(at_down(i)))
        yield modules
    finally:
        for handle in handles:
            handle.remove()


@torch.inference_mode()
def run_windows(model: nn.Module, token_ids: torch.Tensor, window: int, progress: bool, desc: str) -> int:
    """Forward passes over consecutive windows of `window` tokens (the last may be shorter); returns tokens run."""
    if token_ids.dim() != 1 or token_ids.numel() == 0:
        raise ValueError(f"token_ids must be a non-empty 1-D tensor, got shape {tuple(token_ids.shape)}")
    for start in tqdm(range(0, token_ids.numel(), window), desc=desc, disable=not progress, leave=False):
        model(token_ids[start : start + window].unsqueeze(0))
    return token_ids.numel()
