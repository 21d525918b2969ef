"""The Endor ops on mlx arrays: endor_decompress and endor_linear (semantics: flashllm_ext/ops/endor.py), a Metal
kernel on Apple Silicon and mlx ops elsewhere, raising the torch kernels' RuntimeError messages."""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from flashllm_ext.mlx import metal
from flashllm_ext.mlx.metal import metal_source
from flashllm_ext.ops.constants import ENDOR_ROW_CODES, FFN_MAX_TOKENS, METAL_THREADGROUP, metal_header

# Unsigned view of each element type: the kernels copy bits.
_BITS = {mx.float32: mx.uint32, mx.float16: mx.uint16, mx.bfloat16: mx.uint16, mx.int8: mx.uint8}
# EndorRowCode (csrc/common/endor_codes.h), as the Metal kernels write it into row_status.
_ROW_INDEX, _ROW_OFFSETS, _ROW_PADDING, _ROW_COUNT = (
    ENDOR_ROW_CODES[name]
    for name in (
        "kEndorRowIndexOutOfRange",
        "kEndorRowOffsetsInvalid",
        "kEndorRowPaddingBits",
        "kEndorRowCountMismatch",
    )
)


def _fail(msg: str, op: str = "endor_decompress") -> None:
    raise RuntimeError(f"{op}: {msg}")


def _check_metadata(
    values: mx.array, bitmap: mx.array, row_offsets: mx.array, n_cols: int, rows: mx.array | None
) -> int:
    """The metadata checks of csrc/common/endor_checks.h. Returns the number of output rows."""
    if values.dtype not in _BITS:
        _fail(f"values must be float32, float16, bfloat16 or int8, got {values.dtype}")
    n_rows = _check_endor_tensor(values, bitmap, row_offsets, n_cols, "endor_decompress")
    if rows is None:
        return n_rows
    if rows.dtype != mx.int64 or rows.ndim != 1:
        _fail(f"rows must be a 1-D int64 array, got {rows.dtype} of shape {tuple(rows.shape)}")
    return rows.size


def _check_endor_tensor(values: mx.array, bitmap: mx.array, row_offsets: mx.array, n_cols: int, op: str) -> int:
    """check_endor_tensor of csrc/common/endor_checks.h, after the op's check of values' dtype. Returns rows."""
    if values.ndim != 1:
        _fail(f"values must be 1-D, got shape {tuple(values.shape)}", op)
    if bitmap.dtype != mx.uint8 or bitmap.ndim != 2:
        _fail(f"bitmap must be a 2-D uint8 array, got {bitmap.dtype} of shape {tuple(bitmap.shape)}", op)
    if n_cols < 0 or bitmap.shape[1] != (n_cols + 7) // 8:
        _fail(f"bitmap has {bitmap.shape[1]} bytes per row, n_cols={n_cols} needs {(n_cols + 7) // 8}", op)
    n_rows = bitmap.shape[0]
    if row_offsets.dtype != mx.int64 or row_offsets.ndim != 1 or row_offsets.size != n_rows + 1:
        _fail(
            f"row_offsets must be int64 of length rows+1={n_rows + 1}, got {row_offsets.dtype} "
            f"of shape {tuple(row_offsets.shape)}",
            op,
        )
    return n_rows


def _check_offset_ends(values: mx.array, row_offsets: mx.array, op: str = "endor_decompress") -> None:
    first, last = int(row_offsets[0].item()), int(row_offsets[-1].item())
    if first != 0 or last != values.size:
        _fail(f"row_offsets must start at 0 and end at values.numel()={values.size}, got {first}..{last}", op)


def _raise_row_error(
    out_row: int,
    code: int,
    values: mx.array,
    bitmap: mx.array,
    row_offsets: mx.array,
    n_cols: int,
    rows: mx.array | None,
    op: str,
) -> None:
    """The RuntimeError for a row a kernel refused, worded as the torch kernels word it."""
    n_rows = bitmap.shape[0]
    r = int(rows[out_row].item()) if rows is not None else out_row
    if code == _ROW_INDEX:
        _fail(f"rows[{out_row}]={r} is outside [0, {n_rows})", op)
    start, end = int(row_offsets[r].item()), int(row_offsets[r + 1].item())
    if code == _ROW_OFFSETS:
        _fail(f"row {r}: row_offsets [{start}, {end}) is not a range inside values ({values.size} elements)", op)
    if code == _ROW_PADDING:
        _fail(f"row {r}: bitmap has bits set past n_cols={n_cols}", op)
    set_bits = sum(bin(int(b)).count("1") for b in bitmap[r].tolist())
    _fail(f"row {r}: row_offsets says {end - start} values but the bitmap has {set_bits} set bits", op)


def _check_status(
    status: mx.array,
    values: mx.array,
    bitmap: mx.array,
    row_offsets: mx.array,
    n_cols: int,
    rows: mx.array | None,
    op: str = "endor_decompress",
) -> None:
    """Raises for the first output row whose status is not 0."""
    bad = status != 0
    if bool(mx.any(bad).item()):
        out_row = int(mx.argmax(bad).item())
        _raise_row_error(out_row, int(status[out_row].item()), values, bitmap, row_offsets, n_cols, rows, op)


def _popcount_bytes(b: mx.array) -> mx.array:
    """Set bits of each uint8, as int64."""
    return ((b[..., None] >> mx.arange(8, dtype=mx.uint8)) & 1).astype(mx.int64).sum(axis=-1)


def _decompress_mlx_ops(
    values: mx.array,
    bitmap: mx.array,
    row_offsets: mx.array,
    n_cols: int,
    rows: mx.array | None,
    op: str = "endor_decompress",
) -> mx.array:
    """Fallback with mlx ops: check the rows read, unpack their bits, cumsum to value indices, gather."""
    n_rows, nnz = bitmap.shape[0], values.size
    src = rows if rows is not None else mx.arange(n_rows, dtype=mx.int64)
    in_range = (src >= 0) & (src < n_rows)
    safe = mx.where(in_range, src, 0)
    starts, ends = row_offsets[safe], row_offsets[safe + 1]
    row_bitmap = bitmap[safe]
    padding = (row_bitmap[:, -1] >> (n_cols % 8)) != 0 if n_cols % 8 else mx.zeros(src.shape, dtype=mx.bool_)
    status = mx.where(
        ~in_range,
        _ROW_INDEX,
        mx.where(
            (starts < 0) | (starts > ends) | (ends > nnz),
            _ROW_OFFSETS,
            mx.where(
                padding, _ROW_PADDING, mx.where(ends - starts != _popcount_bytes(row_bitmap).sum(axis=1), _ROW_COUNT, 0)
            ),
        ),
    )
    _check_status(status, values, bitmap, row_offsets, n_cols, rows, op)

    bits_dtype = _BITS[values.dtype]
    n_out = src.size
    if nnz == 0 or n_cols == 0 or n_out == 0:
        return mx.zeros((n_out, n_cols), dtype=values.dtype)
    mask = ((row_bitmap[:, :, None] >> mx.arange(8, dtype=mx.uint8)) & 1).reshape(n_out, -1)[:, :n_cols] != 0
    index = mx.cumsum(mask.astype(mx.int64), axis=1) - 1 + starts[:, None]
    index = mx.where(mask, index, 0)  # every index read is then inside the checked row range
    gathered = mx.take(values.view(bits_dtype), index)
    return mx.where(mask, gathered, mx.zeros((), dtype=bits_dtype)).view(values.dtype)


@lru_cache(maxsize=None)
def _endor_kernel():
    return mx.fast.metal_kernel(
        name="flashllm_endor_decompress",
        input_names=["values", "bitmap", "row_offsets", "rows", "params"],
        output_names=["out", "row_status"],
        header=metal_header(),
        source=metal_source("endor_decompress.metal"),
    )


def _decompress_metal(
    values: mx.array, bitmap: mx.array, row_offsets: mx.array, n_cols: int, rows: mx.array | None
) -> mx.array:
    """metal/endor_decompress.metal: one simdgroup per output row."""
    n_rows, nnz = bitmap.shape[0], values.size
    n_out = rows.size if rows is not None else n_rows
    bits_dtype = _BITS[values.dtype]
    # Zero-size buffers are avoided with 1-element placeholders the kernel never reads (params says why).
    bits = values.view(bits_dtype) if nnz else mx.zeros((1,), dtype=bits_dtype)
    params = mx.array([n_rows, n_cols, nnz, n_out], dtype=mx.int64)
    threads = 32 * n_out
    grid = (threads + METAL_THREADGROUP - 1) // METAL_THREADGROUP * METAL_THREADGROUP
    out, status = _endor_kernel()(
        inputs=[
            bits,
            bitmap.reshape(-1) if bitmap.size else mx.zeros((1,), dtype=mx.uint8),
            row_offsets,
            rows if rows is not None else mx.zeros((1,), dtype=mx.int64),
            params,
        ],
        template=[("T", bits_dtype), ("HAS_ROWS", rows is not None)],
        grid=(grid, 1, 1),
        threadgroup=(METAL_THREADGROUP, 1, 1),
        output_shapes=[(n_out, n_cols), (n_out,)],
        output_dtypes=[bits_dtype, mx.int32],
    )
    _check_status(status, values, bitmap, row_offsets, n_cols, rows)
    return out.view(values.dtype)


def endor_decompress(
    values: mx.array, bitmap: mx.array, row_offsets: mx.array, n_cols: int, rows: mx.array | None = None
) -> mx.array:
    """Dense rows of an Endor tensor, as torch.ops.flashllm.endor_decompress.

    values [nnz] (float32/float16/bfloat16/int8), bitmap uint8 [R, ceil(n_cols/8)], row_offsets int64 [R+1],
    rows int64 [K] or None -> [K or R, n_cols] of values.dtype. Raises RuntimeError when row_offsets does not span
    values, or on a bad row among those read (index out of range, offsets outside values, a bit set past n_cols,
    length != popcount of its bitmap row).
    """
    n_out = _check_metadata(values, bitmap, row_offsets, n_cols, rows)
    _check_offset_ends(values, row_offsets)
    if n_out == 0:
        return mx.zeros((0, n_cols), dtype=values.dtype)
    if metal.metal_available() and n_cols > 0:  # (n_out, 0) would be a zero-size Metal buffer
        return _decompress_metal(values, bitmap, row_offsets, n_cols, rows)
    return _decompress_mlx_ops(values, bitmap, row_offsets, n_cols, rows)


# ------------------------------------------------------------------------------------------------ endor_linear
_LINEAR_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def _check_linear(
    x: mx.array, values: mx.array, bitmap: mx.array, row_offsets: mx.array, n_cols: int, bias: mx.array | None
) -> int:
    """check_endor_linear_args of csrc/common/endor_checks.h, then the offsets' ends. Returns rows."""
    op = "endor_linear"
    if values.dtype not in _LINEAR_DTYPES:
        _fail(
            f"values must be float32, float16 or bfloat16 (int8 is not supported: it needs a scale), got "
            f"{values.dtype}",
            op,
        )
    if x.ndim != 2 or x.dtype not in (values.dtype, mx.float32):
        _fail(
            f"x must be a 2-D {values.dtype} or float32 tensor [T, n_cols], got {x.dtype} of shape {tuple(x.shape)}", op
        )
    n_rows = _check_endor_tensor(values, bitmap, row_offsets, n_cols, op)
    if x.shape[1] != n_cols:
        _fail(f"x has {x.shape[1]} columns but the weight has n_cols={n_cols}", op)
    if bias is not None and (bias.dtype != x.dtype or bias.ndim != 1 or bias.shape[0] != n_rows):
        _fail(f"bias must be {x.dtype} of shape [rows={n_rows}], got {bias.dtype} of shape {tuple(bias.shape)}", op)
    _check_offset_ends(values, row_offsets, op)
    return n_rows


@lru_cache(maxsize=None)
def _linear_kernel():
    return mx.fast.metal_kernel(
        name="flashllm_endor_linear",
        input_names=["x", "values", "bitmap", "row_offsets", "bias", "params"],
        output_names=["y", "row_status"],
        header=metal_header(),
        source=metal_source("endor_linear.metal"),
    )


def _linear_metal(
    x: mx.array,
    values: mx.array,
    bitmap: mx.array,
    row_offsets: mx.array,
    n_cols: int,
    bias: mx.array | None,
    n_rows: int,
) -> mx.array:
    """metal/endor_linear.metal per group of 8 tokens: one simdgroup per row."""
    xf = x.astype(mx.float32)
    b = bias.astype(mx.float32) if bias is not None else mx.zeros((1,), dtype=mx.float32)
    vals = values if values.size else mx.zeros((1,), dtype=values.dtype)
    grid = (32 * n_rows + METAL_THREADGROUP - 1) // METAL_THREADGROUP * METAL_THREADGROUP
    outs = []
    for t0 in range(0, x.shape[0], FFN_MAX_TOKENS):
        xs = xf[t0 : t0 + FFN_MAX_TOKENS]
        nt = xs.shape[0]
        y, status = _linear_kernel()(
            inputs=[
                xs.reshape(-1),
                vals,
                bitmap.reshape(-1),
                row_offsets,
                b,
                mx.array([n_rows, n_cols, values.size, nt], dtype=mx.int64),
            ],
            template=[("T", values.dtype), ("HAS_BIAS", bias is not None)],
            grid=(grid, 1, 1),
            threadgroup=(METAL_THREADGROUP, 1, 1),
            output_shapes=[(nt, n_rows), (n_rows,)],
            output_dtypes=[mx.float32, mx.int32],
        )
        _check_status(status, values, bitmap, row_offsets, n_cols, None, "endor_linear")
        outs.append(y)
    return mx.concatenate(outs).astype(x.dtype)


def endor_linear(
    x: mx.array, values: mx.array, bitmap: mx.array, row_offsets: mx.array, n_cols: int, bias: mx.array | None = None
) -> mx.array:
    """torch.ops.flashllm.endor_linear on mlx arrays: y = x W^T (+ bias) from an Endor tensor W [R, n_cols].

    x [T, n_cols] of values' dtype or float32; values float32/float16/bfloat16; bias [R] of x's dtype or None
    -> [T, R] of x's dtype, float32 accumulation. Raises RuntimeError on bad arguments or a bad row, as the torch
    kernels do. The Metal kernel never materialises W; the fallback decompresses, then multiplies.
    """
    n_rows = _check_linear(x, values, bitmap, row_offsets, n_cols, bias)
    if n_rows == 0 or x.shape[0] == 0 or n_cols == 0:
        y = mx.zeros((x.shape[0], n_rows), dtype=mx.float32)
        return (y + bias.astype(mx.float32) if bias is not None else y).astype(x.dtype)
    if metal.metal_available():
        return _linear_metal(x, values, bitmap, row_offsets, n_cols, bias, n_rows)
    w = _decompress_mlx_ops(values, bitmap, row_offsets, n_cols, None, "endor_linear")
    y = x.astype(mx.float32) @ w.astype(mx.float32).T
    return (y + bias.astype(mx.float32) if bias is not None else y).astype(x.dtype)


# ------------------------------------------------------------------------------------------------ sparse_ffn
