"""The flashllm ops, one typed function per op: the only way library code calls them.

Each function is a thin wrapper over `torch.ops.flashllm.<op>` (schemas, fake and reference kernels in
flashllm_ext/_ops.py; native kernels in csrc/<device>/<op>*): the tensors come first, every other argument is a
keyword. Shapes below use T tokens, d hidden size, R rows, C cache capacity, N neurons; for attention B
sequences, S keys per sequence, Hq query heads, Hkv kv heads, D head size, P partial results.
"""
from __future__ import annotations

import torch

from . import _ops  # noqa: F401  (registers the schemas, fake and reference kernels)

__all__ = ["cache_compact", "cache_plan", "decode_attention", "endor_decompress", "endor_linear",
           "half_linear", "merge_attention_states", "quant_scores", "sparse_ffn"]


def endor_decompress(values: torch.Tensor, bitmap: torch.Tensor, row_offsets: torch.Tensor, *, n_cols: int,
                     rows: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense rows of an Endor tensor (DESIGN.md §5), bit for bit.

    values: [nnz] float32 | float16 | bfloat16 | int8, the non-zeros in row-major order
    bitmap: uint8 [R, ceil(n_cols/8)], little bit order, each row starting on a byte
    row_offsets: int64 [R + 1], start of each row in `values`; the last entry is nnz
    rows: int64 [K] (any order, repeats allowed) to decompress only those rows, in that order; None for all R
    out: contiguous [K or R, n_cols] of values.dtype to write into (the `.out` overload); None to allocate
    Returns [K or R, n_cols] of values.dtype (`out` when given). Raises RuntimeError naming the bad row.
    """
    if out is None:
        return torch.ops.flashllm.endor_decompress.default(values, bitmap, row_offsets, n_cols, rows)
    torch.ops.flashllm.endor_decompress.out(values, bitmap, row_offsets, n_cols, rows, out=out)
    return out


def endor_linear(x: torch.Tensor, values: torch.Tensor, bitmap: torch.Tensor, row_offsets: torch.Tensor, *,
                 n_cols: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) straight from an Endor tensor W [R, n_cols] (DESIGN.md §5), never materialising W.

    x: [T, n_cols] of values.dtype or float32 (any strides); T = 1..8 is the decode case it is built for
    values: [nnz] float32 | float16 | bfloat16 (int8 is refused: it would need a scale)
    bitmap: uint8 [R, ceil(n_cols/8)]; row_offsets: int64 [R + 1], as endor_decompress takes them
    bias: [R] of x.dtype; None for none
    Returns y: [T, R] of x.dtype, accumulated in float32. Raises RuntimeError naming the bad row (CUDA: with kernel
    checks on; without them a bad row comes out as zeros, common/kernel_checks.h).
    """
    return torch.ops.flashllm.endor_linear.default(x, values, bitmap, row_offsets, n_cols, bias)


def sparse_ffn(x: torch.Tensor, matrix: torch.Tensor, *, num_used: int, activation: str, glu: bool,
               bias: torch.Tensor | None = None, index: torch.Tensor | None = None,
               threshold: float = 0.0) -> torch.Tensor:
    """The FFN of x over the neuron bundles in the rows of `matrix` (float32 accumulation).

    x: [T, d] float32 | float16 | bfloat16
    matrix: [C, 2d] (up | down) or, glu=True, [C, 3d] (up | gate | down), contiguous, x.dtype
    num_used: rows [0, num_used) are in use
    activation: "relu" | "silu" | "gelu" (flashllm_ext._ops.ACTIVATIONS); applied to x.up (x.gate with GLU) + bias
    bias: [C] of x.dtype, the input projection's bias of each row; None for none
    index: int64 [K] of rows < num_used (any order; a repeat counts twice); None for rows [0, num_used)
    threshold: a (token, row) term counts only when |h| > threshold; 0 skips only exact zeros
    Returns y: [T, d] of x.dtype, sum over the rows of h * down (h = act(...), times x.up with GLU).
    """
    return torch.ops.flashllm.sparse_ffn.default(x, matrix, num_used, bias, activation, glu, index, threshold)


def quant_scores(x: torch.Tensor, up_codes: torch.Tensor, up_scale: torch.Tensor, *, up_bits: int,
                 up_bias: torch.Tensor | None = None, gate_codes: torch.Tensor | None = None,
                 gate_scale: torch.Tensor | None = None, gate_bits: int = 4, gate_bias: torch.Tensor | None = None,
                 activation: str = "silu") -> torch.Tensor:
    """|act(x . gate + gate_bias) * (x . up + up_bias)| per neuron (|act(x . up + up_bias)| without a gate) from
    per-row low-bit codes (the quant predictor's scores, flashllm_ext/predictor/quant.py); CPU only.

    x: [T, d] float32 | float16 | bfloat16, d <= 2^20, rounded to int8 per token (flashllm_ext._ops.round_x_int8)
       before the dot products, on every CPU path; T = 1..8 share one pass over the codes
    up_codes: uint8 [N, ceil(d * up_bits / 8)], a little-endian bit stream of codes q per row (8 / up_bits per
              byte, the first in the low bits, for 1, 2 and 4 bits; 8 per 3 bytes for 3 bits)
    up_scale: float16 [N], one scale per row, or [N, G], one per group of d / G columns (d / G a multiple of 64);
              a row (group) is (q - (2^up_bits - 1) / 2) * scale
    up_bits, gate_bits: 1 | 2 | 3 | 4
    up_bias, gate_bias: float32 [N]; None for none
    gate_codes: uint8 [N, ceil(d * gate_bits / 8)] and gate_scale: float16 [N] or [N, G'] for a GLU; None for none
    activation: "relu" | "silu" | "gelu" (flashllm_ext._ops.ACTIVATIONS)
    Returns float32 [T, N].
    """
    return torch.ops.flashllm.quant_scores.default(x, up_codes, up_scale, up_bias, gate_codes, gate_scale, gate_bias,
                                                   up_bits, gate_bits, activation)


def half_linear(x: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x weight^T + bias, computed in float32 from float16 / bfloat16 (or float32) weights; the CPU kernel reads
    each weight row once per 8 tokens (the resident linears of flashllm_ext/linear.py).

    x: [T, d] float32 | float16 | bfloat16
    weight: [n, d] float32 | float16 | bfloat16
    bias: [n] of weight's dtype, or None
    Returns [T, n] of x.dtype.
    """
    return torch.ops.flashllm.half_linear.default(x, weight, bias)


def cache_compact(matrix: torch.Tensor, pointer: torch.Tensor, rows: torch.Tensor, *, num_used: int,
                  bias: torch.Tensor | None = None, slot_of: torch.Tensor | None = None) -> int:
    """Swap-delete cache rows in place: the last used rows move into the holes (flashllm_ext._ops.compaction_moves).

    matrix: [C, W], contiguous; the rows move
    pointer: int64 [C], neuron id of each row; entries [new num_used, num_used) become -1
    rows: int64 [K], distinct rows < num_used to delete
    bias: [C] moved with its rows; None for none
    slot_of: int64 [N], row of each neuron (-1 when absent), kept the inverse of pointer; None for none
    Returns the new num_used (num_used - K).
    """
    return torch.ops.flashllm.cache_compact.default(matrix, pointer, bias, slot_of, num_used, rows)


def cache_plan(active_ids: torch.Tensor, last_active: torch.Tensor, slot_of: torch.Tensor, pointer: torch.Tensor,
               evict_rows: torch.Tensor, missing: torch.Tensor, *, num_used: int, step: int,
               window: int) -> list[int]:
    """One token's decisions of the neuron cache (flashllm_ext/cache.py), in place; CPU only.

    active_ids: int64 [k], this token's active neurons (any order, repeats allowed)
    last_active: int64 [N], last step each neuron was active; set to `step` for the active ids
    slot_of: int64 [N], row of each neuron (-1 when absent); pointer: int64 [C], neuron of each row
    evict_rows: int64 [>= C], receives the rows to evict; missing: int64 [>= C], receives the ids to read
    Returns [w, b, m]: evict_rows[:w] left the `window`, evict_rows[w:w+b] are evicted early (least recently
    active first) because the window's union does not fit, missing[:m] are the distinct active ids not cached.
    Raises RuntimeError, changing nothing, when the token has more distinct active neurons than C.
    """
    return torch.ops.flashllm.cache_plan.default(active_ids, last_active, slot_of, pointer, num_used, step, window,
                                                 evict_rows, missing)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                     scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one new query token per sequence over S keys/values in INF²'s token-major KV block layout.

    q: [B, Hq, D] float32 | float16 | bfloat16
    k, v: [S, B, Hkv, D] of q.dtype ([token][batch x head][head_dim], the on-disk layout); S >= 0; Hq a multiple
      of Hkv: query head h reads kv head h // (Hq // Hkv) (MHA, GQA, MQA). No masking.
    scale: multiplies q.k; None for 1/sqrt(D)
    Any strides are accepted (the native kernels copy an input whose last dimension is not contiguous).
    Returns (out [B, Hq, D] float32, lse [B, Hq] float32): out = softmax(scale q.k) @ v accumulated in float32,
    lse = log sum_j exp(scale q.k_j) (natural log). S = 0 gives out 0 and lse -inf. merge_attention_states
    combines results over disjoint key sets exactly. inf or NaN inputs give NaN in the affected (b, h) (a score of
    exactly -inf gets weight 0). The CUDA kernel takes D <= 256.
    """
    return torch.ops.flashllm.decode_attention.default(q, k, v, scale)


def merge_attention_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact log-sum-exp merge of P partial attention results over disjoint key sets.

    outs: [P, B, H, D] float32; lses: [P, B, H] float32 (decode_attention's outputs, stacked); any strides; P >= 0
    Returns (out [B, H, D], lse [B, H]) float32: lse = log sum_p exp(lse_p), out = sum_p exp(lse_p - lse) out_p.
    A part with lse_p = -inf (no keys) contributes nothing and its out_p is not read; every part empty (or P = 0)
    gives out 0 and lse -inf, never NaN. A NaN or +inf lse_p makes that (b, h)'s out and lse NaN.
    """
    return torch.ops.flashllm.merge_attention_states.default(outs, lses)
