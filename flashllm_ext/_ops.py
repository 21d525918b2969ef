"""Schemas of the `torch.ops.flashllm` ops, their fake (meta) kernels and their pure-torch reference kernels.

The reference kernels are registered as CompositeExplicitAutograd, so they serve every device that has no
native kernel; the native library (flashllm_ext._C) overrides them per dispatch key. They are also the test
oracle and the benchmark baseline. Library code calls the ops through the typed wrappers of flashllm_ext/ops.py.
One section per op: schema, checks, reference kernel, fake kernel.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from .bits import BITS_VIEW, bitmap_row_counts, unpack_bitmap

LIB = torch.library.Library("flashllm", "DEF")

# Each op's checks come in two parts, worded as the native kernels word them (csrc/common/<op>_checks.h):
# `_check_<op>_metadata` (dtypes, ranks, shapes, devices; messaged torch._check, so the fake kernels make them too,
# at no cost and without reading data) and, in the reference kernels only, the data checks that need the values.

# ------------------------------------------------------------------------------------------------ endor_decompress
LIB.define(
    "endor_decompress(Tensor values, Tensor bitmap, Tensor row_offsets, int n_cols, Tensor? rows=None) -> Tensor"
)
LIB.define(
    "endor_decompress.out(Tensor values, Tensor bitmap, Tensor row_offsets, int n_cols, Tensor? rows=None, *, "
    "Tensor(a!) out) -> ()"
)
# The .out overload returns nothing: torch.compile cannot functionalize custom ops whose outputs alias inputs.

# The Endor kernels copy bits, so they serve every element type that has a same-width integer view.
ENDOR_DTYPES = tuple(BITS_VIEW)


def _check_endor_tensor_metadata(op: str, values: torch.Tensor, bitmap: torch.Tensor, row_offsets: torch.Tensor,
                                 n_cols: int) -> None:
    """The metadata checks of an Endor tensor's arrays every Endor op makes (check_endor_tensor in
    csrc/common/endor_checks.h), after its own check of values' dtype."""
    torch._check(values.dim() == 1, lambda: f"{op}: values must be 1-D, got shape {tuple(values.shape)}")
    torch._check(bitmap.dtype == torch.uint8 and bitmap.dim() == 2,
                 lambda: f"{op}: bitmap must be a 2-D uint8 tensor, got {bitmap.dtype} of shape "
                         f"{tuple(bitmap.shape)}")
    torch._check(n_cols >= 0 and bitmap.shape[1] == (n_cols + 7) // 8,
                 lambda: f"{op}: bitmap has {bitmap.shape[1]} bytes per row, n_cols={n_cols} needs "
                         f"{(n_cols + 7) // 8}")
    n_rows = bitmap.shape[0]
    torch._check(row_offsets.dtype == torch.int64 and row_offsets.dim() == 1 and row_offsets.numel() == n_rows + 1,
                 lambda: f"{op}: row_offsets must be int64 of length rows+1={n_rows + 1}, got "
                         f"{row_offsets.dtype} of shape {tuple(row_offsets.shape)}")
    for name, t in (("bitmap", bitmap), ("row_offsets", row_offsets)):
        torch._check(t.device == values.device,
                     lambda: f"{op}: {name} is on {t.device} but values is on {values.device}")


def _check_endor_metadata(values: torch.Tensor, bitmap: torch.Tensor, row_offsets: torch.Tensor, n_cols: int,
                          rows: torch.Tensor | None, out: torch.Tensor | None) -> int:
    """The metadata checks of csrc/common/endor_checks.h. Returns the number of output rows."""
    torch._check(values.dtype in ENDOR_DTYPES,
                 lambda: f"endor_decompress: values must be float32, float16, bfloat16 or int8, got {values.dtype}")
    _check_endor_tensor_metadata("endor_decompress", values, bitmap, row_offsets, n_cols)
    for name, t in (("rows", rows), ("out", out)):
        torch._check(t is None or t.device == values.device,
                     lambda: f"endor_decompress: {name} is on {t.device} but values is on {values.device}")
    n_out = bitmap.shape[0]
    if rows is not None:
        torch._check(rows.dtype == torch.int64 and rows.dim() == 1,
                     lambda: f"endor_decompress: rows must be a 1-D int64 tensor, got {rows.dtype} of shape "
                             f"{tuple(rows.shape)}")
        n_out = rows.shape[0]
    if out is not None:
        torch._check(out.dtype == values.dtype and tuple(out.shape) == (n_out, n_cols) and out.is_contiguous(),
                     lambda: f"endor_decompress: out must be a contiguous {values.dtype} tensor of shape "
                             f"{(n_out, n_cols)}, got {out.dtype} of shape {tuple(out.shape)}")
    return n_out


def _check_endor_tensor_data(op: str, values: torch.Tensor, bitmap: torch.Tensor, row_offsets: torch.Tensor,
                             n_cols: int) -> None:
    """The data checks of an Endor tensor the native kernels make, worded as they word them
    (csrc/common/endor_report.h): row_offsets spans values, then per row, the first bad row raising."""
    def fail(msg: str) -> None:
        raise RuntimeError(f"{op}: {msg}")

    nnz = values.numel()
    if int(row_offsets[0]) != 0 or int(row_offsets[-1]) != nnz:
        fail(f"row_offsets must start at 0 and end at values.numel()={nnz}, "
             f"got {int(row_offsets[0])}..{int(row_offsets[-1])}")
    starts, ends = row_offsets[:-1], row_offsets[1:]
    bad_range = (starts < 0) | (starts > ends) | (ends > nnz)
    bad_padding = (bitmap[:, -1] >> (n_cols % 8)) != 0 if n_cols % 8 else torch.zeros_like(bad_range)
    set_bits = bitmap_row_counts(bitmap)
    bad = bad_range | bad_padding | (ends - starts != set_bits)
    if bool(bad.any()):
        r = int(bad.nonzero()[0])
        start, end = int(starts[r]), int(ends[r])
        if bad_range[r]:
            fail(f"row {r}: row_offsets [{start}, {end}) is not a range inside values ({nnz} elements)")
        if bad_padding[r]:
            fail(f"row {r}: bitmap has bits set past n_cols={n_cols}")
        fail(f"row {r}: row_offsets says {end - start} values but the bitmap has {int(set_bits[r])} set bits")


def check_endor_args(values: torch.Tensor, bitmap: torch.Tensor, row_offsets: torch.Tensor, n_cols: int,
                     rows: torch.Tensor | None, out: torch.Tensor | None = None) -> int:
    """Every check the native kernels make, in torch (data included). Returns the number of output rows."""
    n_out = _check_endor_metadata(values, bitmap, row_offsets, n_cols, rows, out)
    _check_endor_tensor_data("endor_decompress", values, bitmap, row_offsets, n_cols)
    if rows is not None and rows.numel():
        n_rows = bitmap.shape[0]
        outside = (rows < 0) | (rows >= n_rows)
        if bool(outside.any()):
            k = int(outside.nonzero()[0])
            raise RuntimeError(f"endor_decompress: rows[{k}]={int(rows[k])} is outside [0, {n_rows})")
    return n_out


def _scatter_rows(values: torch.Tensor, bitmap: torch.Tensor, starts: torch.Tensor, n_cols: int,
                  out: torch.Tensor) -> torch.Tensor:
    """Dense rows of checked Endor arrays: each row's values scattered to its set bits. bitmap [K, bytes] and
    starts [K] (each row's first value) of the rows wanted -> out [K, n_cols]. Copies bits, never does math."""
    bits = unpack_bitmap(bitmap, n_cols)
    positions = torch.cumsum(bits, dim=1) - 1 + starts[:, None]
    out.zero_()
    out[bits] = values[positions[bits]]
    return out


def endor_decompress_reference(values: torch.Tensor, bitmap: torch.Tensor, row_offsets: torch.Tensor,
                               n_cols: int, rows: torch.Tensor | None = None, *,
                               out: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch decompression: scatter each row's values to its set bits. Bitwise exact (copies, never math)."""
    n_out = check_endor_args(values, bitmap, row_offsets, n_cols, rows, out)
    if out is None:
        out = values.new_empty((n_out, n_cols))
    if rows is not None:
        bitmap, starts = bitmap.index_select(0, rows), row_offsets.index_select(0, rows)
    else:
        starts = row_offsets[:-1]
    return _scatter_rows(values, bitmap, starts, n_cols, out)


@torch.library.impl(LIB, "endor_decompress", "CompositeExplicitAutograd")
def _endor_decompress_default(values, bitmap, row_offsets, n_cols, rows=None):
    return endor_decompress_reference(values, bitmap, row_offsets, n_cols, rows)


@torch.library.impl(LIB, "endor_decompress.out", "CompositeExplicitAutograd")
def _endor_decompress_out_default(values, bitmap, row_offsets, n_cols, rows=None, *, out):
    endor_decompress_reference(values, bitmap, row_offsets, n_cols, rows, out=out)


@torch.library.register_fake("flashllm::endor_decompress")
def _endor_decompress_fake(values, bitmap, row_offsets, n_cols, rows=None):
    n_out = _check_endor_metadata(values, bitmap, row_offsets, n_cols, rows, None)
    return values.new_empty((n_out, n_cols))


@torch.library.register_fake("flashllm::endor_decompress.out")
def _endor_decompress_out_fake(values, bitmap, row_offsets, n_cols, rows=None, *, out):
    _check_endor_metadata(values, bitmap, row_offsets, n_cols, rows, out)


# ------------------------------------------------------------------------------------------------ endor_linear
# y = x W^T (+ bias) with W the Endor tensor [rows, n_cols], computed from values + bitmap without materialising W:
# the decode-time matrix-vector product of an Endor-compressed linear layer (T = 1..8 tokens is the case it is
# built for; more tokens run in groups of 8, each re-reading the weight). Float32 accumulation.
# Dtype rules: values float32 | float16 | bfloat16 (int8 would need a per-row scale the format does not carry yet:
# refused); x is values' dtype or float32; bias (optional) and the output are x's dtype.
LIB.define(
    "endor_linear(Tensor x, Tensor values, Tensor bitmap, Tensor row_offsets, int n_cols, Tensor? bias=None) -> Tensor"
)

ENDOR_LINEAR_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_endor_linear_metadata(x: torch.Tensor, values: torch.Tensor, bitmap: torch.Tensor,
                                 row_offsets: torch.Tensor, n_cols: int, bias: torch.Tensor | None) -> int:
    """The metadata checks of check_endor_linear_args (csrc/common/endor_checks.h). Returns rows."""
    torch._check(values.dtype in ENDOR_LINEAR_DTYPES,
                 lambda: f"endor_linear: values must be float32, float16 or bfloat16 (int8 is not supported: it "
                         f"needs a scale), got {values.dtype}")
    torch._check(x.dim() == 2 and x.dtype in (values.dtype, torch.float32),
                 lambda: f"endor_linear: x must be a 2-D {values.dtype} or float32 tensor [T, n_cols], got "
                         f"{x.dtype} of shape {tuple(x.shape)}")
    _check_endor_tensor_metadata("endor_linear", values, bitmap, row_offsets, n_cols)
    torch._check(x.shape[1] == n_cols,
                 lambda: f"endor_linear: x has {x.shape[1]} columns but the weight has n_cols={n_cols}")
    n_rows = bitmap.shape[0]
    for name, t in (("x", x), ("bias", bias)):
        torch._check(t is None or t.device == values.device,
                     lambda: f"endor_linear: {name} is on {t.device} but values is on {values.device}")
    torch._check(bias is None or (bias.dtype == x.dtype and bias.dim() == 1 and bias.shape[0] == n_rows),
                 lambda: f"endor_linear: bias must be {x.dtype} of shape [rows={n_rows}], got {bias.dtype} of "
                         f"shape {tuple(bias.shape)}")
    return n_rows


def endor_linear_reference(x: torch.Tensor, values: torch.Tensor, bitmap: torch.Tensor, row_offsets: torch.Tensor,
                           n_cols: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch y = x W^T (+ bias): decompress W, then a float32 matmul. x [T, n_cols] -> [T, rows] of x.dtype."""
    _check_endor_linear_metadata(x, values, bitmap, row_offsets, n_cols, bias)
    _check_endor_tensor_data("endor_linear", values, bitmap, row_offsets, n_cols)
    w = _scatter_rows(values, bitmap, row_offsets[:-1], n_cols, values.new_empty((bitmap.shape[0], n_cols)))
    y = x.float() @ w.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@torch.library.impl(LIB, "endor_linear", "CompositeExplicitAutograd")
def _endor_linear_default(x, values, bitmap, row_offsets, n_cols, bias=None):
    return endor_linear_reference(x, values, bitmap, row_offsets, n_cols, bias)


@torch.library.register_fake("flashllm::endor_linear")
def _endor_linear_fake(x, values, bitmap, row_offsets, n_cols, bias=None):
    n_rows = _check_endor_linear_metadata(x, values, bitmap, row_offsets, n_cols, bias)
    return x.new_empty((x.shape[0], n_rows))


# ------------------------------------------------------------------------------------------------ sparse_ffn
# y = sum over cached neuron rows i of h_i * down_i, where a row of `matrix` is one neuron's bundle
# [up_col | gate_col (GLU only) | down_row] (the flash store's layout, DESIGN.md §5) and, per token,
#   non-GLU (OPT):   h_i = act(x . up_i + bias_i)
#   GLU (SwiGLU):    h_i = act(x . gate_i + bias_i) * (x . up_i)
# `bias` is the per-row bias of the input projection (OPT's fc1.bias), held by the neuron cache next to its rows
# so swap-delete moves it with them; the output projection's bias (fc2.bias) is one [d] vector added by the
# caller. Thresholded variant: a (token, row) term is kept only when |h_i| > threshold (the active-neuron rule of
# flashllm_ext.predictor: the GLU product for SwiGLU); threshold 0 skips only exact zeros, which contribute nothing.
LIB.define(
    "sparse_ffn(Tensor x, Tensor matrix, int num_used, Tensor? bias, str activation, bool glu, Tensor? index=None, "
    "float threshold=0.0) -> Tensor"
)

FFN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Activation(NamedTuple):
    """One activation of sparse_ffn."""
    code: int  # what the native and Metal kernels take: FfnActivation in csrc/common/sparse_ffn_checks.h
    fn: Callable[[torch.Tensor], torch.Tensor]  # exact float32 math, as the reference kernel computes it
    config_names: tuple[str, ...]  # Hugging Face config names (hidden_act / activation_function) meaning exactly it


# The one activation table. Only exact config names: tanh-approximated GELU variants would silently differ.
ACTIVATIONS = {
    "relu": Activation(0, torch.relu, ("relu",)),
    "silu": Activation(1, F.silu, ("silu", "swish")),
    "gelu": Activation(2, F.gelu, ("gelu",)),  # erf form
}


def _check_sparse_ffn_metadata(x: torch.Tensor, matrix: torch.Tensor, num_used: int, bias: torch.Tensor | None,
                               activation: str, glu: bool, index: torch.Tensor | None, threshold: float) -> int:
    """The metadata checks of csrc/common/sparse_ffn_checks.h. Returns d (the hidden size)."""
    torch._check(x.dtype in FFN_DTYPES and x.dim() == 2,
                 lambda: f"sparse_ffn: x must be a 2-D float32/float16/bfloat16 tensor [T, d], got {x.dtype} of "
                         f"shape {tuple(x.shape)}")
    d = x.shape[1]
    width = (3 if glu else 2) * d
    torch._check(matrix.dtype == x.dtype and matrix.dim() == 2 and matrix.shape[1] == width,
                 lambda: f"sparse_ffn: matrix must be {x.dtype} of shape [capacity, {width}] ({'3' if glu else '2'} "
                         f"x d={d}), got {matrix.dtype} of shape {tuple(matrix.shape)}")
    torch._check(matrix.stride(1) == 1 and (matrix.shape[0] <= 1 or matrix.stride(0) == width),
                 lambda: "sparse_ffn: matrix must be contiguous")
    torch._check(0 <= num_used <= matrix.shape[0],
                 lambda: f"sparse_ffn: num_used={num_used} is outside [0, capacity={matrix.shape[0]}]")
    torch._check(activation in ACTIVATIONS,
                 lambda: f"sparse_ffn: activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    torch._check(threshold >= 0 and threshold != float("inf"),  # NaN fails the first comparison
                 lambda: f"sparse_ffn: threshold must be finite and >= 0, got {threshold}")
    for name, t in (("matrix", matrix), ("bias", bias), ("index", index)):
        torch._check(t is None or t.device == x.device,
                     lambda: f"sparse_ffn: {name} is on {t.device} but x is on {x.device}")
    torch._check(bias is None or (bias.dtype == x.dtype and bias.dim() == 1 and bias.shape[0] == matrix.shape[0]),
                 lambda: f"sparse_ffn: bias must be {x.dtype} of shape [capacity={matrix.shape[0]}], got "
                         f"{bias.dtype} of shape {tuple(bias.shape)}")
    torch._check(index is None or (index.dtype == torch.int64 and index.dim() == 1),
                 lambda: f"sparse_ffn: index must be a 1-D int64 tensor, got {index.dtype} of shape "
                         f"{tuple(index.shape)}")
    return d


def check_sparse_ffn_args(x: torch.Tensor, matrix: torch.Tensor, num_used: int, bias: torch.Tensor | None,
                          activation: str, glu: bool, index: torch.Tensor | None, threshold: float) -> int:
    """Every check the native kernels make, in torch (index range included). Returns d (the hidden size)."""
    d = _check_sparse_ffn_metadata(x, matrix, num_used, bias, activation, glu, index, threshold)
    if index is not None and index.numel():
        outside = (index < 0) | (index >= num_used)
        if bool(outside.any()):
            k = int(outside.nonzero()[0])
            raise RuntimeError(f"sparse_ffn: index[{k}]={int(index[k])} is outside [0, num_used={num_used})")
    return d


def sparse_ffn_reference(x: torch.Tensor, matrix: torch.Tensor, num_used: int, bias: torch.Tensor | None,
                         activation: str, glu: bool, index: torch.Tensor | None = None,
                         threshold: float = 0.0) -> torch.Tensor:
    """Pure-torch sparse FFN in float32. x [T, d], matrix [capacity, 2d | 3d] -> [T, d] of x.dtype."""
    d = check_sparse_ffn_args(x, matrix, num_used, bias, activation, glu, index, threshold)
    rows = matrix[:num_used] if index is None else matrix[index]
    rows = rows.float()
    xf = x.float()
    first = rows[:, d:2 * d] if glu else rows[:, :d]  # the column the activation applies to
    pre = xf @ first.t()
    if bias is not None:
        row_bias = bias[:num_used] if index is None else bias[index]
        pre = pre + row_bias.float()
    h = ACTIVATIONS[activation].fn(pre)
    if glu:
        h = h * (xf @ rows[:, :d].t())
    if threshold > 0:  # the active-neuron rule: |h| > threshold, h = act(...) (times x.up for GLU)
        h = torch.where(h.abs() > threshold, h, torch.zeros((), dtype=h.dtype, device=h.device))
    return (h @ rows[:, -d:]).to(x.dtype)


@torch.library.impl(LIB, "sparse_ffn", "CompositeExplicitAutograd")
def _sparse_ffn_default(x, matrix, num_used, bias, activation, glu, index=None, threshold=0.0):
    return sparse_ffn_reference(x, matrix, num_used, bias, activation, glu, index, threshold)


@torch.library.register_fake("flashllm::sparse_ffn")
def _sparse_ffn_fake(x, matrix, num_used, bias, activation, glu, index=None, threshold=0.0):
    _check_sparse_ffn_metadata(x, matrix, num_used, bias, activation, glu, index, threshold)
    return x.new_empty(x.shape)


# ------------------------------------------------------------------------------------------------ cache_compact
# Swap-delete of cache rows: the rows listed in `rows` (distinct, < num_used) are removed and the last used rows
# move into the holes, carrying their pointer entry and bias; slot_of (neuron id -> row, -1 when absent) follows.
# Returns the new num_used (= num_used - rows.numel()).
LIB.define(
    "cache_compact(Tensor(a!) matrix, Tensor(b!) pointer, Tensor(c!)? bias, Tensor(d!)? slot_of, int num_used, "
    "Tensor rows) -> int"
)


def _check_cache_compact_metadata(matrix: torch.Tensor, pointer: torch.Tensor, bias: torch.Tensor | None,
                                  slot_of: torch.Tensor | None, num_used: int, rows: torch.Tensor) -> None:
    """The metadata checks of csrc/common/cache_compact_checks.h."""
    torch._check(matrix.dim() == 2 and matrix.is_contiguous(),
                 lambda: f"cache_compact: matrix must be a contiguous 2-D tensor, got shape {tuple(matrix.shape)}")
    capacity = matrix.shape[0]
    torch._check(pointer.dtype == torch.int64 and tuple(pointer.shape) == (capacity,),
                 lambda: f"cache_compact: pointer must be int64 of shape [capacity={capacity}], got {pointer.dtype} "
                         f"of shape {tuple(pointer.shape)}")
    torch._check(bias is None or (bias.dim() == 1 and bias.shape[0] == capacity),
                 lambda: f"cache_compact: bias must be 1-D of shape [capacity={capacity}], got shape "
                         f"{tuple(bias.shape)}")
    torch._check(slot_of is None or (slot_of.dtype == torch.int64 and slot_of.dim() == 1),
                 lambda: f"cache_compact: slot_of must be a 1-D int64 tensor, got {slot_of.dtype} of shape "
                         f"{tuple(slot_of.shape)}")
    torch._check(rows.dtype == torch.int64 and rows.dim() == 1,
                 lambda: f"cache_compact: rows must be a 1-D int64 tensor, got {rows.dtype} of shape "
                         f"{tuple(rows.shape)}")
    for name, t in (("pointer", pointer), ("bias", bias), ("slot_of", slot_of), ("rows", rows)):
        torch._check(t is None or t.device == matrix.device,
                     lambda: f"cache_compact: {name} is on {t.device} but matrix is on {matrix.device}")
    torch._check(0 <= num_used <= capacity,
                 lambda: f"cache_compact: num_used={num_used} is outside [0, capacity={capacity}]")
    # Contiguity is what lets the native kernels move rows and entries with plain pointer arithmetic.
    torch._check(all(t is None or t.is_contiguous() for t in (pointer, bias, slot_of)),
                 lambda: "cache_compact: pointer, bias and slot_of must be contiguous (they are updated in place)")


def check_cache_compact_args(matrix: torch.Tensor, pointer: torch.Tensor, bias: torch.Tensor | None,
                             slot_of: torch.Tensor | None, num_used: int, rows: torch.Tensor) -> None:
    """Every check the native kernels make, in torch (data included: rows distinct and < num_used)."""
    _check_cache_compact_metadata(matrix, pointer, bias, slot_of, num_used, rows)
    if rows.numel():
        outside = (rows < 0) | (rows >= num_used)
        if bool(outside.any()):
            k = int(outside.nonzero()[0])
            raise RuntimeError(f"cache_compact: rows[{k}]={int(rows[k])} is outside [0, num_used={num_used})")
        if torch.unique(rows).numel() != rows.numel():
            raise RuntimeError("cache_compact: rows holds a row twice")
    if slot_of is not None and num_used:
        ids = pointer[:num_used]
        if int(ids.min()) < 0 or int(ids.max()) >= slot_of.numel():
            raise RuntimeError(f"cache_compact: pointer[:num_used] holds neuron ids outside [0, "
                               f"slot_of.numel()={slot_of.numel()})")


def compaction_moves(num_used: int, rows: list[int]) -> list[tuple[int, int]]:
    """The (source, hole) row moves of a swap-delete: the holes below the new end, ascending, are filled by the
    surviving rows at or past it, ascending. Every kernel makes exactly these moves."""
    new_used = num_used - len(rows)
    deleted = set(rows)
    holes = sorted(r for r in rows if r < new_used)
    sources = [r for r in range(new_used, num_used) if r not in deleted]
    return list(zip(sources, holes))


def cache_compact_reference(matrix: torch.Tensor, pointer: torch.Tensor, bias: torch.Tensor | None,
                            slot_of: torch.Tensor | None, num_used: int, rows: torch.Tensor) -> int:
    """Swap-delete in place; O(c * row) for c deleted rows. Returns the new num_used."""
    check_cache_compact_args(matrix, pointer, bias, slot_of, num_used, rows)
    deleted = rows.tolist()
    if slot_of is not None and deleted:
        slot_of[pointer[rows]] = -1
    for source, hole in compaction_moves(num_used, deleted):
        matrix[hole] = matrix[source]
        pointer[hole] = pointer[source]
        if bias is not None:
            bias[hole] = bias[source]
        if slot_of is not None:
            slot_of[pointer[hole]] = hole
    new_used = num_used - len(deleted)
    pointer[new_used:num_used] = -1
    return new_used


@torch.library.impl(LIB, "cache_compact", "CompositeExplicitAutograd")
def _cache_compact_default(matrix, pointer, bias, slot_of, num_used, rows):
    return cache_compact_reference(matrix, pointer, bias, slot_of, num_used, rows)


@torch.library.register_fake("flashllm::cache_compact")
def _cache_compact_fake(matrix, pointer, bias, slot_of, num_used, rows):
    _check_cache_compact_metadata(matrix, pointer, bias, slot_of, num_used, rows)
    return num_used - rows.shape[0]


# ------------------------------------------------------------------------------------------------ cache_plan
# One token's decisions of the neuron cache (flashllm_ext/cache.py), in place on its preallocated state:
# last_active[n] = step for the active ids; evict_rows[:w] = rows whose neuron was not active in the last `window`
# steps, evict_rows[w:w+b] = the least recently active other rows when the window's union would not fit (never a row
# active now); missing[:m] = the distinct active ids not cached. Returns [w, b, m]. Raises, changing nothing, when
# the token alone has more distinct active neurons than the cache has rows. CPU only (the state is small).
LIB.define(
    "cache_plan(Tensor active_ids, Tensor(a!) last_active, Tensor slot_of, Tensor pointer, int num_used, int step, "
    "int window, Tensor(b!) evict_rows, Tensor(c!) missing) -> SymInt[]"
)


def _check_cache_plan_metadata(active_ids: torch.Tensor, last_active: torch.Tensor, slot_of: torch.Tensor,
                               pointer: torch.Tensor, num_used: int, window: int, evict_rows: torch.Tensor,
                               missing: torch.Tensor) -> None:
    """The metadata checks of csrc/common/cache_plan_checks.h."""
    tensors = (active_ids, last_active, slot_of, pointer, evict_rows, missing)
    for t in tensors:
        torch._check(t.dtype == torch.int64 and t.dim() == 1 and t.device.type == "cpu",
                     lambda: f"cache_plan: every argument must be a 1-D int64 CPU tensor, got {t.dtype} of shape "
                             f"{tuple(t.shape)} on {t.device}")
    torch._check(all(t.is_contiguous() for t in tensors[1:]), lambda: "cache_plan: state tensors must be contiguous")
    torch._check(last_active.numel() == slot_of.numel(),
                 lambda: f"cache_plan: last_active and slot_of must both have one entry per neuron, got "
                         f"{last_active.numel()} and {slot_of.numel()}")
    capacity = pointer.numel()
    torch._check(evict_rows.numel() >= capacity and missing.numel() >= capacity,
                 lambda: f"cache_plan: evict_rows and missing need capacity={capacity} entries")
    torch._check(0 <= num_used <= capacity,
                 lambda: f"cache_plan: num_used={num_used} is outside [0, capacity={capacity}]")
    torch._check(window >= 1, lambda: f"cache_plan: window must be >= 1, got {window}")


def cache_plan_reference(active_ids: torch.Tensor, last_active: torch.Tensor, slot_of: torch.Tensor,
                         pointer: torch.Tensor, num_used: int, step: int, window: int, evict_rows: torch.Tensor,
                         missing: torch.Tensor) -> list[int]:
    """Pure-torch cache_plan (ties among least recently active rows go to the lower row)."""
    _check_cache_plan_metadata(active_ids, last_active, slot_of, pointer, num_used, window, evict_rows, missing)
    n_neurons, capacity = slot_of.numel(), pointer.numel()
    ids = active_ids.tolist()
    cached = pointer[:num_used]
    if num_used and not (bool(((cached >= 0) & (cached < n_neurons)).all())
                         and torch.equal(slot_of[cached], torch.arange(num_used))):
        i = next(i for i, n in enumerate(cached.tolist()) if not 0 <= n < n_neurons or int(slot_of[n]) != i)
        raise RuntimeError(f"cache_plan: pointer[{i}]={int(cached[i])} disagrees with slot_of: the cache state is "
                           "corrupt")
    for i, n in enumerate(ids):
        if not 0 <= n < n_neurons:
            raise RuntimeError(f"cache_plan: active_ids[{i}]={n} is outside [0, n_neurons={n_neurons})")
        slot = int(slot_of[n])
        if slot >= 0 and not (slot < num_used and int(pointer[slot]) == n):
            raise RuntimeError(f"cache_plan: slot_of[{n}]={slot} disagrees with pointer: the cache state is corrupt")
    distinct = list(dict.fromkeys(ids))
    if len(distinct) > capacity:
        raise RuntimeError(f"cache_plan: the token has {len(distinct)} distinct active neurons but the cache holds "
                           f"{capacity} rows; raise the byte budget")
    absent = [n for n in distinct if int(slot_of[n]) < 0]
    if ids:
        last_active[active_ids] = step
    when = last_active[cached].tolist()
    window_out = [i for i in range(num_used) if when[i] <= step - window]
    over = num_used - len(window_out) + len(absent) - capacity
    budget_out = []
    if over > 0:
        candidates = sorted((when[i], i) for i in range(num_used) if step - window < when[i] != step)
        budget_out = [i for _, i in candidates[:over]]
    out = window_out + budget_out
    evict_rows[:len(out)] = torch.tensor(out, dtype=torch.int64)
    missing[:len(absent)] = torch.tensor(absent, dtype=torch.int64)
    return [len(window_out), len(budget_out), len(absent)]


@torch.library.impl(LIB, "cache_plan", "CompositeExplicitAutograd")
def _cache_plan_default(active_ids, last_active, slot_of, pointer, num_used, step, window, evict_rows, missing):
    return cache_plan_reference(active_ids, last_active, slot_of, pointer, num_used, step, window, evict_rows, missing)


@torch.library.register_fake("flashllm::cache_plan")
def _cache_plan_fake(active_ids, last_active, slot_of, pointer, num_used, step, window, evict_rows, missing):
    _check_cache_plan_metadata(active_ids, last_active, slot_of, pointer, num_used, window, evict_rows, missing)
    # The three counts depend on the data: unbacked sizes (hence SymInt[] in the schema).
    ctx = torch.library.get_ctx()
    return [ctx.new_dynamic_size() for _ in range(3)]


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


def _check_quant_matrix(name: str, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, bits: int,
                        d: int, n: int, device: torch.device) -> None:
    """One matrix's checks of csrc/common/quant_scores_checks.h."""
    torch._check(bits in QUANT_BITS, lambda: f"quant_scores: {name}_bits must be 1, 2, 3 or 4, got {bits}")
    width = -(-d * bits // 8)
    torch._check(codes.dtype == torch.uint8 and codes.dim() == 2 and tuple(codes.shape) == (n, width),
                 lambda: f"quant_scores: {name}_codes must be uint8 of shape [n={n}, ceil(d={d} * {bits} / 8)="
                         f"{width}], got {codes.dtype} of shape {tuple(codes.shape)}")
    torch._check(scale.dtype == torch.float16 and scale.dim() in (1, 2) and scale.shape[0] == n,
                 lambda: f"quant_scores: {name}_scale must be float16 of shape [n={n}] or [n={n}, groups], got "
                         f"{scale.dtype} of shape {tuple(scale.shape)}")
    groups = scale.shape[1] if scale.dim() == 2 else 1
    torch._check(scale.dim() == 1 or (groups > 0 and d % groups == 0 and (d // groups) % QUANT_GROUP_MULTIPLE == 0),
                 lambda: f"quant_scores: {name}_scale has {groups} groups per row: d={d} must split into groups of a "
                         f"multiple of {QUANT_GROUP_MULTIPLE} columns")
    torch._check(bias is None or (bias.dtype == torch.float32 and bias.dim() == 1 and bias.shape[0] == n),
                 lambda: f"quant_scores: {name}_bias must be float32 of shape [n={n}], got {bias.dtype} of shape "
                         f"{tuple(bias.shape)}")
    for t in (codes, scale, bias):
        torch._check(t is None or t.device == device,
                     lambda: f"quant_scores: {name} tensors are on {t.device} but x is on {device}")


def _check_quant_scores_metadata(x: torch.Tensor, up_codes: torch.Tensor, up_scale: torch.Tensor,
                                 up_bias: torch.Tensor | None, gate_codes: torch.Tensor | None,
                                 gate_scale: torch.Tensor | None, gate_bias: torch.Tensor | None, up_bits: int,
                                 gate_bits: int, activation: str) -> None:
    """The checks of csrc/common/quant_scores_checks.h."""
    torch._check(x.dtype in FFN_DTYPES and x.dim() == 2,
                 lambda: f"quant_scores: x must be a 2-D float32/float16/bfloat16 tensor [T, d], got {x.dtype} "
                         f"of shape {tuple(x.shape)}")
    torch._check(up_scale.dim() in (1, 2),
                 lambda: f"quant_scores: up_scale must be float16 of shape [n] or [n, groups], got shape "
                         f"{tuple(up_scale.shape)}")
    d, n = x.shape[1], up_scale.shape[0]
    torch._check(d <= QUANT_MAX_COLUMNS,
                 lambda: f"quant_scores: x has d={d} columns, at most {QUANT_MAX_COLUMNS} (the integer dot products of "
                         "the int8-rounded x sum in int32)")
    _check_quant_matrix("up", up_codes, up_scale, up_bias, up_bits, d, n, x.device)
    torch._check((gate_codes is None) == (gate_scale is None),
                 lambda: "quant_scores: gate_codes and gate_scale come together (both for a GLU, neither otherwise)")
    torch._check(gate_codes is not None or gate_bias is None, lambda: "quant_scores: gate_bias needs gate_codes")
    if gate_codes is not None:
        _check_quant_matrix("gate", gate_codes, gate_scale, gate_bias, gate_bits, d, n, x.device)
    torch._check(activation in ACTIVATIONS,
                 lambda: f"quant_scores: activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")


def unpack_codes(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """uint8 [n, d]: the codes in packed uint8 [n, ceil(d * bits / 8)] (a little-endian bit stream per row: code k
    at bits [k * bits, (k + 1) * bits))."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    stream = (packed.unsqueeze(-1) >> shifts) & 1  # [n, width, 8]: bit j of byte i
    stream = stream.view(packed.shape[0], -1)[:, :d * bits].view(packed.shape[0], d, bits)
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


def quant_scores_reference(x: torch.Tensor, up_codes: torch.Tensor, up_scale: torch.Tensor,
                           up_bias: torch.Tensor | None, gate_codes: torch.Tensor | None,
                           gate_scale: torch.Tensor | None, gate_bias: torch.Tensor | None, up_bits: int,
                           gate_bits: int, activation: str) -> torch.Tensor:
    """Pure-torch quant_scores: round x to int8 per token, dequantise every row, then two float32 matmuls.
    x [T, d] -> float32 [T, n]."""
    _check_quant_scores_metadata(x, up_codes, up_scale, up_bias, gate_codes, gate_scale, gate_bias, up_bits,
                                 gate_bits, activation)
    d, xf, act = x.shape[1], round_x_int8(x), ACTIVATIONS[activation].fn
    up = F.linear(xf, dequantize_rows(up_codes, up_scale, up_bits, d), up_bias)
    if gate_codes is None:
        return act(up).abs()
    return (act(F.linear(xf, dequantize_rows(gate_codes, gate_scale, gate_bits, d), gate_bias)) * up).abs()


@torch.library.impl(LIB, "quant_scores", "CompositeExplicitAutograd")
def _quant_scores_default(x, up_codes, up_scale, up_bias, gate_codes, gate_scale, gate_bias, up_bits, gate_bits,
                          activation):
    return quant_scores_reference(x, up_codes, up_scale, up_bias, gate_codes, gate_scale, gate_bias, up_bits,
                                  gate_bits, activation)


@torch.library.register_fake("flashllm::quant_scores")
def _quant_scores_fake(x, up_codes, up_scale, up_bias, gate_codes, gate_scale, gate_bias, up_bits, gate_bits,
                       activation):
    _check_quant_scores_metadata(x, up_codes, up_scale, up_bias, gate_codes, gate_scale, gate_bias, up_bits,
                                 gate_bits, activation)
    return x.new_empty((x.shape[0], up_scale.shape[0]), dtype=torch.float32)


# ------------------------------------------------------------------------------------------------ half_linear
# y = x W^T + b with W (and b) stored in float16 / bfloat16 (float32 accepted), computed in float32 and returned in
# x's dtype: the resident linears of a flash-loaded model on the CPU (flashllm_ext/linear.py), where PyTorch's fp16
# matmul falls behind once several tokens share a weight pass. CPU kernel only; elsewhere the reference.
LIB.define("half_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def _check_half_linear_metadata(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The checks of csrc/common/half_linear_checks.h."""
    torch._check(x.dtype in FFN_DTYPES and x.dim() == 2,
                 lambda: f"half_linear: x must be a 2-D float32/float16/bfloat16 tensor [T, d], got {x.dtype} of "
                         f"shape {tuple(x.shape)}")
    torch._check(weight.dtype in FFN_DTYPES and weight.dim() == 2 and weight.shape[1] == x.shape[1],
                 lambda: f"half_linear: weight must be a 2-D float32/float16/bfloat16 tensor [n, d={x.shape[1]}], "
                         f"got {weight.dtype} of shape {tuple(weight.shape)}")
    torch._check(bias is None or (bias.dtype == weight.dtype and bias.dim() == 1 and bias.shape[0] == weight.shape[0]),
                 lambda: f"half_linear: bias must be {weight.dtype} (the weight's dtype) of shape [n={weight.shape[0]}], "
                         f"got {bias.dtype} of shape {tuple(bias.shape)}")
    torch._check(weight.device == x.device and (bias is None or bias.device == x.device),
                 lambda: f"half_linear: weight and bias must be on x's device ({x.device}), got {weight.device}"
                         + ("" if bias is None else f" and {bias.device}"))


def half_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Pure-torch half_linear: x [T, d], weight [n, d], bias [n] | None -> [T, n] of x.dtype, in float32."""
    _check_half_linear_metadata(x, weight, bias)
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


@torch.library.impl(LIB, "half_linear", "CompositeExplicitAutograd")
def _half_linear_default(x, weight, bias):
    return half_linear_reference(x, weight, bias)


@torch.library.register_fake("flashllm::half_linear")
def _half_linear_fake(x, weight, bias):
    _check_half_linear_metadata(x, weight, bias)
    return x.new_empty((x.shape[0], weight.shape[0]))


# ------------------------------------------------------------------------------------------------ decode_attention
# One decode step of attention for a block of sequences: each sequence has one new query token and S keys/values
# in the token-major layout of INF²'s on-disk KV blocks, k and v [S, B, Hkv, D] ([token][batch x head][head_dim]).
# Query head h reads kv head h // (Hq // Hkv) (MHA, GQA and MQA alike). Returns the softmax(scale q.k)-weighted sum
# of v and the natural log of the softmax's denominator, both float32: the partial state merge_attention_states
# combines exactly, so attention over disjoint key sets (disk blocks, the writeback buffer, X-cache rows) can run
# anywhere and be merged. No masking: every sequence of a block has the same S. S = 0: out 0, lse -inf.
LIB.define("decode_attention(Tensor q, Tensor k, Tensor v, float? scale=None) -> (Tensor, Tensor)")

ATTENTION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_decode_attention_metadata(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     scale: float | None) -> float:
    """The metadata checks of csrc/common/decode_attention_checks.h. Returns the scale to use."""
    torch._check(q.dtype in ATTENTION_DTYPES and q.dim() == 3,
                 lambda: f"decode_attention: q must be a 3-D float32/float16/bfloat16 tensor [B, Hq, D], got "
                         f"{q.dtype} of shape {list(q.shape)}")
    batch, n_q_heads, head_dim = q.shape
    for name, t in (("k", k), ("v", v)):
        torch._check(t.dtype == q.dtype and t.dim() == 4,
                     lambda: f"decode_attention: {name} must be a 4-D tensor [S, B, Hkv, D] of q's dtype, got "
                             f"{t.dtype} of shape {list(t.shape)}")
        torch._check(t.device == q.device, lambda: f"decode_attention: {name} is on {t.device} but q is on {q.device}")
    torch._check(k.shape == v.shape,
                 lambda: f"decode_attention: k and v must have the same shape, got {list(k.shape)} and "
                         f"{list(v.shape)}")
    torch._check(k.shape[1] == batch and k.shape[3] == head_dim,
                 lambda: f"decode_attention: k and v must be [S, B={batch}, Hkv, D={head_dim}] to match q "
                         f"{list(q.shape)}, got {list(k.shape)}")
    torch._check(head_dim >= 1, lambda: "decode_attention: head_dim D must be >= 1")
    n_kv_heads = k.shape[2]
    torch._check(n_kv_heads >= 1 and n_q_heads >= 1 and n_q_heads % n_kv_heads == 0,
                 lambda: f"decode_attention: the query heads Hq={n_q_heads} must be a positive multiple of the kv "
                         f"heads Hkv={n_kv_heads}")
    if scale is None:
        return head_dim ** -0.5
    torch._check(math.isfinite(scale), lambda: f"decode_attention: scale must be finite, got {scale}")
    return scale


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch decode attention in float32 (two passes: exact logsumexp, then the weighted sum).
    q [B, Hq, D], k and v [S, B, Hkv, D] -> out [B, Hq, D] float32, lse [B, Hq] float32."""
    scale = _check_decode_attention_metadata(q, k, v, scale)
    batch, n_q_heads, head_dim = q.shape
    n_kv_heads = k.shape[2]
    qf = q.float().reshape(batch, n_kv_heads, n_q_heads // n_kv_heads, head_dim)
    scores = torch.einsum("bhgd,sbhd->bhgs", qf, k.float()) * scale
    lse = torch.logsumexp(scores, dim=-1)  # -inf when S = 0
    weights = torch.exp(scores - lse[..., None])
    out = torch.einsum("bhgs,sbhd->bhgd", weights, v.float())  # zeros when S = 0
    return out.reshape(batch, n_q_heads, head_dim).contiguous(), lse.reshape(batch, n_q_heads).contiguous()


@torch.library.impl(LIB, "decode_attention", "CompositeExplicitAutograd")
def _decode_attention_default(q, k, v, scale=None):
    return decode_attention_reference(q, k, v, scale)


@torch.library.register_fake("flashllm::decode_attention")
def _decode_attention_fake(q, k, v, scale=None):
    _check_decode_attention_metadata(q, k, v, scale)
    return q.new_empty(q.shape, dtype=torch.float32), q.new_empty(q.shape[:2], dtype=torch.float32)


# ------------------------------------------------------------------------------------------------ merge_attention_states
# The exact log-sum-exp merge of P partial attention results over disjoint key sets:
#   lse = log sum_p exp(lse_p),  out = sum_p exp(lse_p - lse) out_p.
# A part whose weight exp(lse_p - lse) is 0 (lse_p = -inf: an empty part) contributes nothing, its out_p not read
# (so an empty part's buffer may hold anything). Every part empty: out 0 and lse -inf, never NaN (FlashInfer and
# vLLM computed exp(-inf - -inf) = NaN there). A NaN lse_p, or a +inf one, makes that (b, h)'s out and lse NaN.
LIB.define("merge_attention_states(Tensor outs, Tensor lses) -> (Tensor, Tensor)")


def _check_merge_attention_states_metadata(outs: torch.Tensor, lses: torch.Tensor) -> None:
    """The metadata checks of csrc/common/merge_attention_states_checks.h."""
    torch._check(outs.dtype == torch.float32 and outs.dim() == 4,
                 lambda: f"merge_attention_states: outs must be a 4-D float32 tensor [P, B, H, D], got {outs.dtype} "
                         f"of shape {list(outs.shape)}")
    torch._check(lses.dtype == torch.float32 and lses.dim() == 3,
                 lambda: f"merge_attention_states: lses must be a 3-D float32 tensor [P, B, H], got {lses.dtype} "
                         f"of shape {list(lses.shape)}")
    torch._check(lses.shape == outs.shape[:3],
                 lambda: f"merge_attention_states: lses must be [P, B, H] = {list(outs.shape[:3])} to match outs "
                         f"{list(outs.shape)}, got {list(lses.shape)}")
    torch._check(lses.device == outs.device,
                 lambda: f"merge_attention_states: lses is on {lses.device} but outs is on {outs.device}")


def merge_attention_states_reference(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch log-sum-exp merge. outs [P, B, H, D], lses [P, B, H] -> out [B, H, D], lse [B, H] (float32)."""
    _check_merge_attention_states_metadata(outs, lses)
    if lses.shape[0] == 0:
        return outs.new_zeros(outs.shape[1:]), lses.new_full(lses.shape[1:], float("-inf"))
    top = lses.amax(dim=0)  # NaN propagates; +inf makes lses - top NaN below
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)  # every part empty: exp(-inf - 0) = 0
    scaled = torch.exp(lses - top)
    total = scaled.sum(dim=0)
    lse = top + torch.log(total)  # log 0 = -inf when every part is empty
    weights = scaled / torch.where(total == 0, torch.ones_like(total), total)
    terms = torch.where(weights[..., None] == 0, torch.zeros((), device=outs.device), weights[..., None] * outs)
    return terms.sum(dim=0), lse


@torch.library.impl(LIB, "merge_attention_states", "CompositeExplicitAutograd")
def _merge_attention_states_default(outs, lses):
    return merge_attention_states_reference(outs, lses)


@torch.library.register_fake("flashllm::merge_attention_states")
def _merge_attention_states_fake(outs, lses):
    _check_merge_attention_states_metadata(outs, lses)
    return outs.new_empty(outs.shape[1:]), lses.new_empty(lses.shape[1:])
