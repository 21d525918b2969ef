"""quant_scores: a predictor's activation scores from 1-4-bit codes of W_up / W_gate and int8 inputs.

Each op: schema, checks (worded as the native kernels word them, csrc/common/<op>_checks.h), pure-torch
reference kernel (registered as CompositeExplicitAutograd: every device without a native kernel, the test
oracle and the benchmark baseline), fake kernel, and the typed wrapper library code calls.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from flashllm_ext.ops.library import LIB
from flashllm_ext.ops.ffn import ACTIVATIONS, FFN_DTYPES


# ------------------------------------------------------------------------------------------------ quant_scores
# The quant predictor's scores (flashllm_ext/predictor/quant.py): |act(x . gate + gate_bias) * (x . up + up_bias)|
# per neuron, or |act(x . up + up_bias)| without a gate, from rows stored as `bits`-bit codes q (a little-endian bit
# stream per row: code k at bits [k * bits, (k + 1) * bits), so 8 / bits codes per byte, the first in the low bits,
# for 1, 2 and 4 bits, and 8 codes per 3 bytes for 3 bits) and float16 scales s, one per row ([n]) or one per group
# of d / G consecutive columns ([n, G], d / G a multiple of QUANT_GROUP_MULTIPLE, so a group is whole steps of every
# kernel path): w = (q - (2^bits - 1) / 2) * s, and x rounded to int8 per token first (round_x_int8), on every path:
# the dot products are then integer sums (AVX-512 VNNI's vpdpbusd multiplies the unsigned codes into int8 x 64 at a
# time), and a predictor selects the same neurons on every machine. CPU only (the low-bit copies are the predictor's
# DRAM-resident state).
LIB.define(
    "quant_scores(Tensor x, Tensor up_codes, Tensor up_scale, Tensor? up_bias, Tensor? gate_codes, "
    "Tensor? gate_scale, Tensor? gate_bias, int up_bits, int gate_bits, str activation) -> Tensor"
)
QUANT_BITS = (1, 2, 3, 4)
QUANT_MAX_COLUMNS = 1 << 20  # 15 * 127 * 2^20 < 2^31: a row's integer dot product fits in int32
QUANT_GROUP_MULTIPLE = 64  # columns: a scale group is whole 64-code steps of the kernels


def _check_quant_matrix(
    name: str,
    codes: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    bits: int,
    d: int,
    n: int,
    device: torch.device,
) -> None:
    """One matrix's checks of csrc/common/quant_scores_checks.h."""
    torch._check(bits in QUANT_BITS, lambda: f"quant_scores: {name}_bits must be 1, 2, 3 or 4, got {bits}")
    width = -(-d * bits // 8)
    torch._check(
        codes.dtype == torch.uint8 and codes.dim() == 2 and tuple(codes.shape) == (n, width),
        lambda: (
            f"quant_scores: {name}_codes must be uint8 of shape [n={n}, ceil(d={d} * {bits} / 8)="
            f"{width}], got {codes.dtype} of shape {tuple(codes.shape)}"
        ),
    )
    torch._check(
        scale.dtype == torch.float16 and scale.dim() in (1, 2) and scale.shape[0] == n,
        lambda: (
            f"quant_scores: {name}_scale must be float16 of shape [n={n}] or [n={n}, groups], got "
            f"{scale.dtype} of shape {tuple(scale.shape)}"
        ),
    )
    groups = scale.shape[1] if scale.dim() == 2 else 1
    torch._check(
        scale.dim() == 1 or (groups > 0 and d % groups == 0 and (d // groups) % QUANT_GROUP_MULTIPLE == 0),
        lambda: (
            f"quant_scores: {name}_scale has {groups} groups per row: d={d} must split into groups of a "
            f"multiple of {QUANT_GROUP_MULTIPLE} columns"
        ),
    )
    torch._check(
        bias is None or (bias.dtype == torch.float32 and bias.dim() == 1 and bias.shape[0] == n),
        lambda: (
            f"quant_scores: {name}_bias must be float32 of shape [n={n}], got {bias.dtype} of shape {tuple(bias.shape)}"
        ),
    )
    for t in (codes, scale, bias):
        torch._check(
            t is None or t.device == device,
            lambda: f"quant_scores: {name} tensors are on {t.device} but x is on {device}",
        )


def _check_quant_scores_metadata(
    x: torch.Tensor,
    up_codes: torch.Tensor,
    up_scale: torch.Tensor,
    up_bias: torch.Tensor | None,
    gate_codes: torch.Tensor | None,
    gate_scale: torch.Tensor | None,
    gate_bias: torch.Tensor | None,
    up_bits: int,
    gate_bits: int,
    activation: str,
) -> None:
    """The checks of csrc/common/quant_scores_checks.h."""
    torch._check(
        x.dtype in FFN_DTYPES and x.dim() == 2,
        lambda: (
            f"quant_scores: x must be a 2-D float32/float16/bfloat16 tensor [T, d], got {x.dtype} "
            f"of shape {tuple(x.shape)}"
        ),
    )
    torch._check(
        up_scale.dim() in (1, 2),
        lambda: (
            f"quant_scores: up_scale must be float16 of shape [n] or [n, groups], got shape {tuple(up_scale.shape)}"
        ),
    )
    d, n = x.shape[1], up_scale.shape[0]
    torch._check(
        d <= QUANT_MAX_COLUMNS,
        lambda: (
            f"quant_scores: x has d={d} columns, at most {QUANT_MAX_COLUMNS} (the integer dot products of "
            "the int8-rounded x sum in int32)"
        ),
    )
    _check_quant_matrix("up", up_codes, up_scale, up_bias, up_bits, d, n, x.device)
    torch._check(
        (gate_codes is None) == (gate_scale is None),
        lambda: "quant_scores: gate_codes and gate_scale come together (both for a GLU, neither otherwise)",
    )
    torch._check(gate_codes is not None or gate_bias is None, lambda: "quant_scores: gate_bias needs gate_codes")
    if gate_codes is not None:
        _check_quant_matrix("gate", gate_codes, gate_scale, gate_bias, gate_bits, d, n, x.device)
    torch._check(
        activation in ACTIVATIONS,
        lambda: f"quant_scores: activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}",
    )


def unpack_codes(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """uint8 [n, d]: the codes in packed uint8 [n, ceil(d * bits / 8)] (a little-endian bit stream per row: code k
    at bits [k * bits, (k + 1) * bits))."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    stream = (packed.unsqueeze(-1) >> shifts) & 1  # [n, width, 8]: bit j of byte i
    stream = stream.view(packed.shape[0], -1)[:, : d * bits].view(packed.shape[0], d, bits)
    return (stream << shifts[:bits]).sum(-1, dtype=torch.uint8)


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """float32 [n, d]: the rows that codes uint8 [n, ceil(d * bits / 8)] and scales float16 [n] (or [n, G]: one per
    group of d / G columns) stand for."""
    scale = scale.float().view(scale.shape[0], -1)
    per_column = scale.repeat_interleave(d // scale.shape[1], dim=1) if d else scale[:, :0]
    return (unpack_codes(codes, bits, d).float() - ((1 << bits) - 1) / 2) * per_column


def round_x_int8(x: torch.Tensor) -> torch.Tensor:
    """float32 [T, d]: x [T, d] rounded to int8 per token, as quant_scores scores it: q = round(x * (127 / max|x|))
    (half to even), x ~ q * max|x| / 127. A token with a non-finite entry becomes all NaN; an all-zero one stays 0."""
    xf = x.float()
    if xf.shape[1] == 0:
        return xf
    finite = xf.isfinite().all(1, keepdim=True)
    peak = xf.abs().amax(1, keepdim=True)
    inv = torch.where(finite & (peak > 0), 127 / peak, torch.zeros_like(peak))
    q = (xf * inv).round().clamp(-127, 127)
    return q * torch.where(finite, peak / 127, torch.full_like(peak, float("nan")))


def quant_scores_reference(
    x: torch.Tensor,
    up_codes: torch.Tensor,
    up_scale: torch.Tensor,
    up_bias: torch.Tensor | None,
    gate_codes: torch.Tensor | None,
    gate_scale: torch.Tensor | None,
    gate_bias: torch.Tensor | None,
    up_bits: int,
    gate_bits: int,
    activation: str,
) -> torch.Tensor:
    """Pure-torch quant_scores: round x to int8 per token, dequantise every row, then two float32 matmuls.
    x [T, d] -> float32 [T, n]."""
    _check_quant_scores_metadata(
        x, up_codes, up_scale, up_bias, gate_codes, gate_scale, gate_bias, up_bits, gate_bits, activation
    )
    d, xf, act = x.shape[1], round_x_int8(x), ACTIVATIONS[activation].fn
    up = F.linear(xf, dequantize_rows(up_codes, up_scale, up_bits, d), up_bias)
    if gate_codes is None:
        return act(up).abs()
    return (act(F.linear(xf, dequantize_rows(gate_codes, gate_scale, gate_bits, d), gate_bias)) * up).abs()


@torch.library.impl(LIB, "quant_scores", "CompositeExplicitAutograd")
def _quant_scores_default(
    x, up_codes, up_scale, up_bias, gate_codes, gate_scale, gate_bias, up_bits, gate_bits, activation
):
    return quant_scores_reference(
        x, up_codes, up_scale, up_bias, gate_codes, gate_scale, gate_bias, up_bits, gate_bits, activation
    )


@torch.library.register_fake("flashllm::quant_scores")
def _quant_scores_fake(
    x, up_codes, up_scale, up_bias, gate_codes, gate_scale, gate_bias, up_bits, gate_bits, activation
):
    _check_quant_scores_metadata(
        x, up_codes, up_scale, up_bias, gate_codes, gate_scale, gate_bias, up_bits, gate_bits, activation
    )
    return x.new_empty((x.shape[0], up_scale.shape[0]), dtype=torch.float32)


def quant_scores(
    x: torch.Tensor,
    up_codes: torch.Tensor,
    up_scale: torch.Tensor,
    *,
    up_bits: int,
    up_bias: torch.Tensor | None = None,
    gate_codes: torch.Tensor | None = None,
    gate_scale: torch.Tensor | None = None,
    gate_bits: int = 4,
    gate_bias: torch.Tensor | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """|act(x . gate + gate_bias) * (x . up + up_bias)| per neuron (|act(x . up + up_bias)| without a gate) from
    per-row low-bit codes (the quant predictor's scores, flashllm_ext/predictor/quant.py); CPU only.

    x: [T, d] float32 | float16 | bfloat16, d <= 2^20, rounded to int8 per token (flashllm_ext.ops.round_x_int8)
       before the dot products, on every CPU path; T = 1..8 share one pass over the codes
    up_codes: uint8 [N, ceil(d * up_bits / 8)], a little-endian bit stream of codes q per row (8 / up_bits per
              byte, the first in the low bits, for 1, 2 and 4 bits; 8 per 3 bytes for 3 bits)
    up_scale: float16 [N], one scale per row, or [N, G], one per group of d / G columns (d / G a multiple of 64);
              a row (group) is (q - (2^up_bits - 1) / 2) * scale
    up_bits, gate_bits: 1 | 2 | 3 | 4
    up_bias, gate_bias: float32 [N]; None for none
    gate_codes: uint8 [N, ceil(d * gate_bits / 8)] and gate_scale: float16 [N] or [N, G'] for a GLU; None for none
    activation: "relu" | "silu" | "gelu" | "gelu_tanh" (flashllm_ext.ops.ACTIVATIONS)
    Returns float32 [T, N].
    """
    return torch.ops.flashllm.quant_scores.default(
        x, up_codes, up_scale, up_bias, gate_codes, gate_scale, gate_bias, up_bits, gate_bits, activation
    )
