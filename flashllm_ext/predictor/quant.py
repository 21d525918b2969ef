"""Low-bit copies of the input projections (method "quant"): W_gate and W_up quantised per row to 1, 2, 3 or 4 bits
(1 bit = sign and scale), resident in DRAM, from which the score |act(x . gate + b) * (x . up)| is computed exactly
in form and approximately in value.

A row w [d] is stored as codes q in [0, 2^b) packed as a little-endian bit stream (code k at bits [k b, (k + 1) b)
of the row's bytes) and float16 scales s, one per row or one per group of `group_size` consecutive columns (a multiple
of 64 dividing d): w ~ (q - (2^b - 1) / 2) * s, each s chosen to minimise its row's or group's squared error (a grid
over fractions of max|w|). Groups of 192 on the default model (d = 576) cost 16 / 192 = 0.083 bit per weight.
The codes are then rounded either to the nearest level ("nearest") or, given the layer's calibration inputs X, by
GPTQ ("gptq", flashllm_ext.ops.gptq: minimising ||X (w - w_q)||^2, the error of the pre-activations x . w the scores
are made of, rather than ||w - w_q||^2). Both give the same format, scales and kernel: only the codes differ.
Scoring is the op quant_scores (flashllm_ext/ops.py): a CPU kernel reading each code once, never dequantising, with x
rounded to int8 per token (integer dot products: AVX-512 VNNI where the CPU has it)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from flashllm_ext import ops
from flashllm_ext.ops import QUANT_GROUP_MULTIPLE
from flashllm_ext.ops.gptq import gptq_codes, gptq_factor
from flashllm_ext.predictor.base import NeuronPredictor
from flashllm_ext.predictor.rule import ffn_weights

BITS = (1, 2, 3, 4)
ROUNDINGS = ("nearest", "gptq")


MIN_DEFAULT_GROUP = 192  # columns: a float16 scale per group then costs at most 16 / 192 = 0.083 bit per weight


def default_group_size(d: int) -> int | None:
    """Columns per scale when not told ("auto"): the least multiple of 64 that is at least MIN_DEFAULT_GROUP and
    divides d (192 on the default model, d = 576; 256 for d = 4096); None (one scale per row) if there is none."""
    return next((g for g in range(MIN_DEFAULT_GROUP, d + 1, QUANT_GROUP_MULTIPLE) if d % g == 0), None)


def check_group_size(group_size: int | None, d: int) -> None:
    """Refuse a group size the quant_scores kernels cannot take (None: one scale per row)."""
    if group_size is not None and (group_size <= 0 or group_size % QUANT_GROUP_MULTIPLE or d % group_size):
        raise ValueError(
            f"group_size must be a positive multiple of {QUANT_GROUP_MULTIPLE} dividing d={d} (or None "
            f"for one scale per row), got {group_size}"
        )


def quantize_rows(
    w: torch.Tensor, bits: int, grid: int = 20, inputs: torch.Tensor | None = None, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [n, ceil(d * bits / 8)], scales float16 [n], or [n, d / group_size] with groups) of w [n, d]
    (see the module doc). inputs [N, d]: calibration inputs of the layer: GPTQ rounding against them (None: round to
    nearest)."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    w = w.float()
    n, d = w.shape
    check_group_size(group_size, d)
    if inputs is not None and (inputs.dim() != 2 or inputs.shape[1] != d):
        raise ValueError(f"GPTQ needs calibration inputs [N, d={d}], got {tuple(inputs.shape)}")
    levels, center = 1 << bits, ((1 << bits) - 1) / 2
    groups = w.reshape(-1, group_size or d)  # one scale per row of this view
    peak = groups.abs().amax(1, keepdim=True).clamp_min(1e-12)
    best_err, best_scale = None, None
    for fraction in torch.linspace(1.0 / grid, 1.0, grid):
        scale = (fraction * peak / center).half().float()  # the error of the scale as stored
        deq = (torch.clamp(torch.round(groups / scale + center), 0, levels - 1) - center) * scale
        err = (deq - groups).pow(2).sum(1, keepdim=True)
        if best_err is None:
            best_err, best_scale = err, scale
        else:
            better = err < best_err
            best_err, best_scale = torch.where(better, err, best_err), torch.where(better, scale, best_scale)
    scales = best_scale.view(n, -1)  # [n, groups]
    if inputs is None:
        column_scale = scales.repeat_interleave(group_size or d, dim=1)  # [n, d]
        codes = torch.clamp(torch.round(w / column_scale + center), 0, levels - 1).to(torch.uint8)
    else:
        codes = gptq_codes(w, gptq_factor(inputs), scales, -center * scales, group_size or d, 0, levels - 1)
        codes = codes.to(torch.uint8)
    scales = scales.half()
    return pack_codes(codes, bits), scales if group_size else scales.squeeze(1)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [n, ceil(d * bits / 8)]: codes uint8 [n, d] (< 2^bits) as a little-endian bit stream per row (code k at
    bits [k * bits, (k + 1) * bits); for 1, 2 and 4 bits: 8 / bits per byte, the first in the low bits)."""
    n, d = codes.shape
    width = -(-d * bits // 8)
    stream = torch.zeros(n, width * 8, dtype=torch.uint8)
    stream[:, : d * bits] = ((codes.unsqueeze(-1) >> torch.arange(bits, dtype=torch.uint8)) & 1).view(n, d * bits)
    return (stream.view(n, width, 8) << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


class _QuantLayer(nn.Module):
    def __init__(
        self,
        d: int,
        n: int,
        glu: bool,
        gate_bits: int,
        up_bits: int,
        gate_bias: bool,
        up_bias: bool,
        group_size: int | None,
    ):
        super().__init__()
        self.d = d
        scale_shape = (n,) if group_size is None else (n, d // group_size)
        self.register_buffer("up_codes", torch.zeros(n, -(-d * up_bits // 8), dtype=torch.uint8))
        self.register_buffer("up_scale", torch.zeros(scale_shape, dtype=torch.float16))
        self.register_buffer("up_bias", torch.zeros(n) if up_bias else None)
        self.register_buffer("gate_codes", torch.zeros(n, -(-d * gate_bits // 8), dtype=torch.uint8) if glu else None)
        self.register_buffer("gate_scale", torch.zeros(scale_shape, dtype=torch.float16) if glu else None)
        self.register_buffer("gate_bias", torch.zeros(n) if glu and gate_bias else None)


class QuantPredictor(NeuronPredictor):
    """scores = |h| computed from low-bit copies of W_gate (gate_bits) and W_up (up_bits) with one scale per row
    (group_size None) or per group of group_size columns, their codes rounded by `rounding` (one of ROUNDINGS)."""

    method = "quant"

    def __init__(
        self,
        n_layers: int,
        hidden_size: int,
        n_neurons: int,
        activation: str,
        glu: bool,
        gate_bits: int = 4,
        up_bits: int = 2,
        gate_bias: bool = False,
        up_bias: bool = False,
        thresholds: torch.Tensor | None = None,
        rounding: str = "nearest",
        group_size: int | None = None,
    ):
        for bits in (gate_bits, up_bits):
            if bits not in BITS:
                raise ValueError(f"bits must be one of {BITS}, got {bits}")
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        check_group_size(group_size, hidden_size)
        super().__init__(n_layers, hidden_size, n_neurons, thresholds)
        self.activation, self.glu, self.rounding, self.group_size = activation, glu, rounding, group_size
        self.gate_bits, self.up_bits, self.gate_bias, self.up_bias = gate_bits, up_bits, gate_bias, up_bias
        self.layers = nn.ModuleList(
            _QuantLayer(hidden_size, n_neurons, glu, gate_bits, up_bits, gate_bias, up_bias, group_size)
            for _ in range(n_layers)
        )

    @classmethod
    def from_model(
        cls,
        model: nn.Module,
        gate_bits: int,
        up_bits: int,
        thresholds: torch.Tensor | None = None,
        rounding: str = "nearest",
        inputs: Sequence[torch.Tensor] | None = None,
        group_size: int | str | None = None,
        progress: bool = False,
    ) -> QuantPredictor:
        """Quantise the input projections of a Llama-family or OPT model (default bits: training.DEFAULT_RECIPE).
        inputs (per layer [N, d], the FFN's calibration inputs): what rounding "gptq" minimises the error on.
        group_size: columns per scale, None for one per row, "auto" for default_group_size(d)."""
        weights, activation = ffn_weights(model)
        first = weights[0]
        if group_size == "auto":
            group_size = default_group_size(first.up.shape[1])
        out = cls(
            len(weights),
            first.up.shape[1],
            first.up.shape[0],
            activation,
            first.gate is not None,
            gate_bits,
            up_bits,
            first.gate_bias is not None,
            first.up_bias is not None,
            thresholds,
            rounding,
            group_size,
        )
        if rounding == "gptq" and (inputs is None or len(inputs) != len(weights)):
            raise ValueError(
                f"rounding 'gptq' needs calibration inputs for each of the {len(weights)} layers, got "
                f"{None if inputs is None else len(inputs)}"
            )
        for i in tqdm(range(len(weights)), desc="quantising predictors", disable=not progress):
            layer, w = out.layers[i], weights[i]
            x = inputs[i].float() if rounding == "gptq" else None
            codes, scale = quantize_rows(w.up, up_bits, inputs=x, group_size=group_size)
            layer.up_codes.copy_(codes)
            layer.up_scale.copy_(scale)
            if w.gate is not None:
                codes, scale = quantize_rows(w.gate, gate_bits, inputs=x, group_size=group_size)
                layer.gate_codes.copy_(codes)
                layer.gate_scale.copy_(scale)
            for name in ("up_bias", "gate_bias"):
                if getattr(w, name) is not None:
                    getattr(layer, name).copy_(getattr(w, name))
        return out.eval()

    @torch.no_grad()
    def scores(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        q = self.layers[layer]
        return ops.quant_scores(
            x,
            q.up_codes,
            q.up_scale,
            up_bits=self.up_bits,
            up_bias=q.up_bias,
            gate_codes=q.gate_codes,
            gate_scale=q.gate_scale,
            gate_bits=self.gate_bits,
            gate_bias=q.gate_bias,
            activation=self.activation,
        )

    def config(self) -> dict:
        return {
            **super().config(),
            "activation": self.activation,
            "glu": self.glu,
            "gate_bits": self.gate_bits,
            "up_bits": self.up_bits,
            "gate_bias": self.gate_bias,
            "up_bias": self.up_bias,
            "rounding": self.rounding,
            "group_size": self.group_size,
        }

    @classmethod
    def from_config(cls, config: dict) -> QuantPredictor:
        return cls(
            int(config["n_layers"]),
            int(config["hidden_size"]),
            int(config["n_neurons"]),
            str(config["activation"]),
            bool(config["glu"]),
            int(config["gate_bits"]),
            int(config["up_bits"]),
            bool(config["gate_bias"]),
            bool(config["up_bias"]),
            rounding=str(config.get("rounding", "nearest")),  # predictors saved before GPTQ: nearest
            group_size=config.get("group_size"),
        )  # and before groups: one scale per row
