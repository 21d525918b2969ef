"""Schemas of the `torch.ops.flashllm` ops, their fake (meta) kernels and their pure-torch reference kernels.

The reference kernels are registered as CompositeExplicitAutograd, so they serve every device that has no
native kernel; the native library (flashllm_ext._C) overrides them per dispatch key. They are also the test
oracle and the benchmark baseline.
"""
from __future__ import annotations

import torch

LIB = torch.library.Library("flashllm", "DEF")

LIB.define(
    "endor_decompress(Tensor values, Tensor bitmap, Tensor row_offsets, int n_cols, Tensor? rows=None) -> Tensor"
)
LIB.define(
    "endor_decompress.out(Tensor values, Tensor bitmap, Tensor row_offsets, int n_cols, Tensor? rows=None, *, "
    "Tensor(a!) out) -> ()"
)
# The .out overload returns nothing: torch.compile cannot functionalize custom ops whose outputs alias inputs.

# Element sizes the Endor kernels move; they copy bits, so one integer view per width serves every dtype.
ENDOR_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8)
_POPCOUNT_LUT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int64)
_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


def _fail(msg: str) -> None:
    raise RuntimeError(f"endor_decompress: {msg}")


def bitmap_row_counts(bitmap: torch.Tensor) -> torch.Tensor:
    """Number of set bits per row of a packed bitmap. bitmap: uint8 [rows, bytes] -> int64 [rows]."""
    return _POPCOUNT_LUT.to(bitmap.device)[bitmap.long()].sum(dim=1)


def unpack_bitmap(bitmap: torch.Tensor, n_cols: int) -> torch.Tensor:
    """Little bit order, as numpy.packbits(..., bitorder="little"). uint8 [rows, bytes] -> bool [rows, n_cols]."""
    bits = (bitmap.unsqueeze(-1) >> _BIT_SHIFTS.to(bitmap.device)) & 1
    return bits.reshape(bitmap.shape[0], -1)[:, :n_cols].bool()


def check_endor_args(values: torch.Tensor, bitmap: torch.Tensor, row_offsets: torch.Tensor, n_cols: int,
                     rows: torch.Tensor | None, out: torch.Tensor | None = None) -> int:
    """Every check the native kernels make, in torch. Returns the number of output rows."""
    if values.dtype not in ENDOR_DTYPES:
        _fail(f"values must be one of {ENDOR_DTYPES}, got {values.dtype}")
    if values.dim() != 1:
        _fail(f"values must be 1-D, got shape {tuple(values.shape)}")
    if bitmap.dtype != torch.uint8 or bitmap.dim() != 2:
        _fail(f"bitmap must be a 2-D uint8 tensor, got {bitmap.dtype} of shape {tuple(bitmap.shape)}")
    if n_cols < 0 or bitmap.shape[1] != (n_cols + 7) // 8:
        _fail(f"bitmap has {bitmap.shape[1]} bytes per row, n_cols={n_cols} needs {(n_cols + 7) // 8}")
    n_rows = bitmap.shape[0]
    if row_offsets.dtype != torch.int64 or row_offsets.dim() != 1 or row_offsets.numel() != n_rows + 1:
        _fail(f"row_offsets must be int64 of length rows+1={n_rows + 1}, got {row_offsets.dtype} "
              f"of shape {tuple(row_offsets.shape)}")
    for name, t in (("bitmap", bitmap), ("row_offsets", row_offsets), ("rows", rows), ("out", out)):
        if t is not None and t.device != values.device:
            _fail(f"{name} is on {t.device} but values is on {values.device}")
    if int(row_offsets[0]) != 0 or int(row_offsets[-1]) != values.numel():
        _fail(f"row_offsets must start at 0 and end at values.numel()={values.numel()}, "
              f"got {int(row_offsets[0])}..{int(row_offsets[-1])}")
    if n_cols % 8 and n_rows and bool((bitmap[:, -1] >> (n_cols % 8)).any()):
        bad = int((bitmap[:, -1] >> (n_cols % 8)).nonzero()[0])
        _fail(f"row {bad}: bitmap has bits set past n_cols={n_cols}")
    counts = row_offsets.diff()
    if bool((counts < 0).any()):
        _fail("row_offsets must be non-decreasing")
    if not torch.equal(counts, bitmap_row_counts(bitmap)):
        bad = int((counts != bitmap_row_counts(bitmap)).nonzero()[0])
        _fail(f"row {bad}: row_offsets says {int(counts[bad])} values but the bitmap has "
              f"{int(bitmap_row_counts(bitmap[bad:bad + 1]))} set bits")
    n_out = n_rows
    if rows is not None:
        if rows.dtype != torch.int64 or rows.dim() != 1:
            _fail(f"rows must be a 1-D int64 tensor, got {rows.dtype} of shape {tuple(rows.shape)}")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n_rows):
            _fail(f"rows holds indices outside [0, {n_rows})")
        n_out = rows.numel()
    if out is not None:
        if out.dtype != values.dtype or tuple(out.shape) != (n_out, n_cols) or not out.is_contiguous():
            _fail(f"out must be a contiguous {values.dtype} tensor of shape {(n_out, n_cols)}, "
                  f"got {out.dtype} of shape {tuple(out.shape)}")
    return n_out


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
    bits = unpack_bitmap(bitmap, n_cols)
    positions = torch.cumsum(bits, dim=1) - 1 + starts[:, None]
    out.zero_()
    out[bits] = values[positions[bits]]
    return out


@torch.library.impl(LIB, "endor_decompress", "CompositeExplicitAutograd")
def _endor_decompress_default(values, bitmap, row_offsets, n_cols, rows=None):
    return endor_decompress_reference(values, bitmap, row_offsets, n_cols, rows)


@torch.library.impl(LIB, "endor_decompress.out", "CompositeExplicitAutograd")
def _endor_decompress_out_default(values, bitmap, row_offsets, n_cols, rows=None, *, out):
    endor_decompress_reference(values, bitmap, row_offsets, n_cols, rows, out=out)


@torch.library.register_fake("flashllm::endor_decompress")
def _endor_decompress_fake(values, bitmap, row_offsets, n_cols, rows=None):
    n_out = bitmap.shape[0] if rows is None else rows.shape[0]
    return values.new_empty((n_out, n_cols))


@torch.library.register_fake("flashllm::endor_decompress.out")
def _endor_decompress_out_fake(values, bitmap, row_offsets, n_cols, rows=None, *, out):
    return None


# ------------------------------------------------------------------------------------------------ sparse_ffn
# y = sum over cached neuron rows i of h_i * down_i, where a row of `matrix` is one neuron's bundle
# [up_col | gate_col (GLU only) | down_row] (the flash store's layout, DESIGN.md §5) and, per token,
#   non-GLU (OPT):   h_i = act(x . up_i + bias_i)
#   GLU (SwiGLU):    h_i = act(x . gate_i + bias_i) * (x . up_i)
# `bias` is the per-row bias of the input projection (OPT's fc1.bias), held by the neuron cache next to its rows
# so swap-delete moves it with them; the output projection's bias (fc2.bias) is one [d] vector added by the
# caller. Thresholded variant: a (token, row) term is kept only when |act(...)| > threshold (the activation before
# the GLU product, the "gate" score of flashllm_ext.predictor, which calls a neuron active when its score is above
# the threshold); threshold 0 skips only exact zeros, which contribute nothing.
LIB.define(
    "sparse_ffn(Tensor x, Tensor matrix, int num_used, Tensor? bias, str activation, bool glu, Tensor? index=None, "
    "float threshold=0.0) -> Tensor"
)
# Swap-delete of cache rows: the rows listed in `rows` (distinct, < num_used) are removed and the last used rows
# move into the holes, carrying their pointer entry and bias; slot_of (neuron id -> row, -1 when absent) follows.
# Returns the new num_used (= num_used - rows.numel()).
LIB.define(
    "cache_compact(Tensor(a!) matrix, Tensor(b!) pointer, Tensor(c!)? bias, Tensor(d!)? slot_of, int num_used, "
    "Tensor rows) -> int"
)

FFN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ACTIVATIONS = ("relu", "silu", "gelu")


def _ffn_fail(msg: str) -> None:
    raise RuntimeError(f"sparse_ffn: {msg}")


def check_sparse_ffn_args(x: torch.Tensor, matrix: torch.Tensor, num_used: int, bias: torch.Tensor | None,
                          activation: str, glu: bool, index: torch.Tensor | None, threshold: float) -> int:
    """Every check the native kernels make, in torch. Returns d (the hidden size)."""
    if x.dtype not in FFN_DTYPES or x.dim() != 2:
        _ffn_fail(f"x must be a 2-D float32/float16/bfloat16 tensor [T, d], got {x.dtype} of shape {tuple(x.shape)}")
    d = x.shape[1]
    width = (3 if glu else 2) * d
    if matrix.dtype != x.dtype or matrix.dim() != 2 or matrix.shape[1] != width:
        _ffn_fail(f"matrix must be {x.dtype} of shape [capacity, {width}] ({'3' if glu else '2'} x d={d}), got "
                  f"{matrix.dtype} of shape {tuple(matrix.shape)}")
    if matrix.stride(1) != 1 or (matrix.shape[0] > 1 and matrix.stride(0) != width):
        _ffn_fail("matrix must be contiguous")
    if not 0 <= num_used <= matrix.shape[0]:
        _ffn_fail(f"num_used={num_used} is outside [0, capacity={matrix.shape[0]}]")
    if activation not in ACTIVATIONS:
        _ffn_fail(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not threshold >= 0 or threshold == float("inf"):
        _ffn_fail(f"threshold must be finite and >= 0, got {threshold}")
    for name, t in (("matrix", matrix), ("bias", bias), ("index", index)):
        if t is not None and t.device != x.device:
            _ffn_fail(f"{name} is on {t.device} but x is on {x.device}")
    if bias is not None and (bias.dtype != x.dtype or bias.dim() != 1 or bias.shape[0] != matrix.shape[0]):
        _ffn_fail(f"bias must be {x.dtype} of shape [capacity={matrix.shape[0]}], got {bias.dtype} of shape "
                  f"{tuple(bias.shape)}")
    if index is not None:
        if index.dtype != torch.int64 or index.dim() != 1:
            _ffn_fail(f"index must be a 1-D int64 tensor, got {index.dtype} of shape {tuple(index.shape)}")
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= num_used):
            bad = int(((index < 0) | (index >= num_used)).nonzero()[0])
            _ffn_fail(f"index[{bad}]={int(index[bad])} is outside [0, num_used={num_used})")
    return d


def apply_activation(pre: torch.Tensor, activation: str) -> torch.Tensor:
    """relu | silu | gelu (exact, erf form) of a float32 tensor."""
    if activation == "relu":
        return torch.relu(pre)
    if activation == "silu":
        return torch.nn.functional.silu(pre)
    return torch.nn.functional.gelu(pre)


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
    h = apply_activation(pre, activation)
    if threshold > 0:
        h = torch.where(h.abs() > threshold, h, torch.zeros((), dtype=h.dtype, device=h.device))
    if glu:
        h = h * (xf @ rows[:, :d].t())
    return (h @ rows[:, -d:]).to(x.dtype)


@torch.library.impl(LIB, "sparse_ffn", "CompositeExplicitAutograd")
def _sparse_ffn_default(x, matrix, num_used, bias, activation, glu, index=None, threshold=0.0):
    return sparse_ffn_reference(x, matrix, num_used, bias, activation, glu, index, threshold)


@torch.library.register_fake("flashllm::sparse_ffn")
def _sparse_ffn_fake(x, matrix, num_used, bias, activation, glu, index=None, threshold=0.0):
    return x.new_empty(x.shape)


def _compact_fail(msg: str) -> None:
    raise RuntimeError(f"cache_compact: {msg}")


def check_cache_compact_args(matrix: torch.Tensor, pointer: torch.Tensor, bias: torch.Tensor | None,
                             slot_of: torch.Tensor | None, num_used: int, rows: torch.Tensor) -> None:
    """The checks of the native kernels, in torch (data checks included: rows distinct and < num_used)."""
    if matrix.dim() != 2 or not matrix.is_contiguous():
        _compact_fail(f"matrix must be a contiguous 2-D tensor, got shape {tuple(matrix.shape)}")
    capacity = matrix.shape[0]
    if pointer.dtype != torch.int64 or tuple(pointer.shape) != (capacity,):
        _compact_fail(f"pointer must be int64 of shape [capacity={capacity}], got {pointer.dtype} of shape "
                      f"{tuple(pointer.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != capacity):
        _compact_fail(f"bias must be 1-D of shape [capacity={capacity}], got shape {tuple(bias.shape)}")
    if slot_of is not None and (slot_of.dtype != torch.int64 or slot_of.dim() != 1):
        _compact_fail(f"slot_of must be a 1-D int64 tensor, got {slot_of.dtype} of shape {tuple(slot_of.shape)}")
    if rows.dtype != torch.int64 or rows.dim() != 1:
        _compact_fail(f"rows must be a 1-D int64 tensor, got {rows.dtype} of shape {tuple(rows.shape)}")
    for name, t in (("pointer", pointer), ("bias", bias), ("slot_of", slot_of), ("rows", rows)):
        if t is not None and t.device != matrix.device:
            _compact_fail(f"{name} is on {t.device} but matrix is on {matrix.device}")
    if not 0 <= num_used <= capacity:
        _compact_fail(f"num_used={num_used} is outside [0, capacity={capacity}]")
    if rows.numel():
        if int(rows.min()) < 0 or int(rows.max()) >= num_used:
            bad = int(((rows < 0) | (rows >= num_used)).nonzero()[0])
            _compact_fail(f"rows[{bad}]={int(rows[bad])} is outside [0, num_used={num_used})")
        if torch.unique(rows).numel() != rows.numel():
            _compact_fail("rows holds a row twice")
    if slot_of is not None and num_used:
        ids = pointer[:num_used]
        if int(ids.min()) < 0 or int(ids.max()) >= slot_of.numel():
            _compact_fail(f"pointer[:num_used] holds neuron ids outside [0, slot_of.numel()={slot_of.numel()})")


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
    return num_used - rows.shape[0]


# One token's decisions of the neuron cache (flashllm_ext/cache.py), in place on its preallocated state:
# last_active[n] = step for the active ids; evict_rows[:w] = rows whose neuron was not active in the last `window`
# steps, evict_rows[w:w+b] = the least recently active other rows when the window's union would not fit (never a row
# active now); missing[:m] = the distinct active ids not cached. Returns [w, b, m]. Raises, changing nothing, when
# the token alone has more distinct active neurons than the cache has rows. CPU only (the state is small).
LIB.define(
    "cache_plan(Tensor active_ids, Tensor(a!) last_active, Tensor slot_of, Tensor pointer, int num_used, int step, "
    "int window, Tensor(b!) evict_rows, Tensor(c!) missing) -> int[]"
)


def cache_plan_reference(active_ids: torch.Tensor, last_active: torch.Tensor, slot_of: torch.Tensor,
                         pointer: torch.Tensor, num_used: int, step: int, window: int, evict_rows: torch.Tensor,
                         missing: torch.Tensor) -> list[int]:
    """Pure-torch cache_plan (ties among least recently active rows go to the lower row)."""
    n_neurons, capacity = slot_of.numel(), pointer.numel()
    if window < 1:
        raise RuntimeError(f"cache_plan: window must be >= 1, got {window}")
    ids = active_ids.tolist()
    for i, n in enumerate(ids):
        if not 0 <= n < n_neurons:
            raise RuntimeError(f"cache_plan: active_ids[{i}]={n} is outside [0, n_neurons={n_neurons})")
    distinct = list(dict.fromkeys(ids))
    if len(distinct) > capacity:
        raise RuntimeError(f"cache_plan: the token has {len(distinct)} distinct active neurons but the cache holds "
                           f"{capacity} rows; raise the byte budget")
    absent = [n for n in distinct if int(slot_of[n]) < 0]
    if ids:
        last_active[active_ids] = step
    when = last_active[pointer[:num_used]].tolist() if num_used else []
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
