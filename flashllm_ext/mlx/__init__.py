"""MLX backend: flashllm ops on `mlx.core` arrays.

Importing this module imports mlx (`import flashllm_ext` alone never does). On Apple Silicon with Metal the ops run
the kernels in `metal/` through `mx.fast.metal_kernel`; elsewhere (Linux, mlx[cpu]) they run a fallback made of
mlx ops. Both move bits, so NaN payloads and -0.0 survive, and both check their inputs as the torch kernels do,
raising the same RuntimeError messages.

On these ops stands the MLX engine: MLXTransfer (transfer.py: a NeuronCache's rows in mx.arrays), MLXFlashFFN and
MLXStreamingFFN (ffn.py: FlashFFN and StreamingFFN computing with sparse_ffn on them) and a Llama-family decoder
with `load_flash` (model.py).
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

import mlx.core as mx

from flashllm_ext.ops import ACTIVATIONS
from flashllm_ext.ops.constants import (
    ENDOR_ROW_CODES,
    FFN_MAX_CHUNKS,
    FFN_MAX_TOKENS,
    FFN_ROWS_PER_CHUNK,
    METAL_THREADGROUP,
    metal_header,
)

__all__ = [
    "MLXFlashFFN",
    "MLXStreamingFFN",
    "MLXTransfer",
    "endor_decompress",
    "endor_linear",
    "load_flash",
    "metal_available",
    "metal_source",
    "sparse_ffn",
]

# Unsigned view of each element type: the kernels copy bits.
_BITS = {mx.float32: mx.uint32, mx.float16: mx.uint16, mx.bfloat16: mx.uint16, mx.int8: mx.uint8}
# Metal kernel bodies: `flashllm_ext/metal` is a link to the top-level `metal/` in a checkout and a real folder in
# an installed package (package data in pyproject.toml), so one resource path serves both.
METAL_DIR = resources.files("flashllm_ext") / "metal"
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


def metal_available() -> bool:
    return mx.metal.is_available()


def metal_source(name: str) -> str:
    """Text of the kernel body `metal/<name>`."""
    path = METAL_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"Metal kernel body {name} not found in {METAL_DIR}: broken install?")
    return path.read_text()


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
    if metal_available() and n_cols > 0:  # (n_out, 0) would be a zero-size Metal buffer
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
    if metal_available():
        return _linear_metal(x, values, bitmap, row_offsets, n_cols, bias, n_rows)
    w = _decompress_mlx_ops(values, bitmap, row_offsets, n_cols, None, "endor_linear")
    y = x.astype(mx.float32) @ w.astype(mx.float32).T
    return (y + bias.astype(mx.float32) if bias is not None else y).astype(x.dtype)


# ------------------------------------------------------------------------------------------------ sparse_ffn
_FFN_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# Launch geometry of metal/sparse_ffn_*.metal (csrc/common/ffn_grid.h, mirrored in flashllm_ext.ops.constants).


def _ffn_fail(msg: str) -> None:
    raise RuntimeError(f"sparse_ffn: {msg}")


def _check_ffn(
    x: mx.array,
    matrix: mx.array,
    num_used: int,
    bias: mx.array | None,
    activation: str,
    glu: bool,
    index: mx.array | None,
    threshold: float,
) -> int:
    """The checks of csrc/common/sparse_ffn_checks.h plus the index range. Returns d."""
    if x.dtype not in _FFN_DTYPES or x.ndim != 2:
        _ffn_fail(f"x must be a 2-D float32/float16/bfloat16 tensor [T, d], got {x.dtype} of shape {tuple(x.shape)}")
    d = x.shape[1]
    width = (3 if glu else 2) * d
    if matrix.dtype != x.dtype or matrix.ndim != 2 or matrix.shape[1] != width:
        _ffn_fail(
            f"matrix must be {x.dtype} of shape [capacity, {width}], got {matrix.dtype} of shape {tuple(matrix.shape)}"
        )
    if not 0 <= num_used <= matrix.shape[0]:
        _ffn_fail(f"num_used={num_used} is outside [0, capacity={matrix.shape[0]}]")
    if activation not in ACTIVATIONS:
        _ffn_fail(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    if not threshold >= 0 or threshold == float("inf"):
        _ffn_fail(f"threshold must be finite and >= 0, got {threshold}")
    if bias is not None and (bias.dtype != x.dtype or bias.ndim != 1 or bias.shape[0] != matrix.shape[0]):
        _ffn_fail(
            f"bias must be {x.dtype} of shape [capacity={matrix.shape[0]}], got {bias.dtype} of shape "
            f"{tuple(bias.shape)}"
        )
    if index is not None:
        if index.dtype != mx.int64 or index.ndim != 1:
            _ffn_fail(f"index must be a 1-D int64 tensor, got {index.dtype} of shape {tuple(index.shape)}")
        bad = (index < 0) | (index >= num_used)
        if index.size and bool(mx.any(bad).item()):
            k = int(mx.argmax(bad).item())
            _ffn_fail(f"index[{k}]={int(index[k].item())} is outside [0, num_used={num_used})")
    return d


def _activate(pre: mx.array, activation: str) -> mx.array:
    if activation == "relu":
        return mx.maximum(pre, 0)
    if activation == "silu":
        return pre * mx.sigmoid(pre)
    return 0.5 * pre * (1 + mx.erf(pre * 0.7071067811865476))


def _sparse_ffn_mlx_ops(x, matrix, num_used, bias, activation, glu, index, threshold, d):
    """Fallback with mlx ops, float32: gather the rows, two matmuls."""
    ids = index if index is not None else mx.arange(num_used)
    rows = matrix[ids].astype(mx.float32)
    xf = x.astype(mx.float32)
    first = rows[:, d : 2 * d] if glu else rows[:, :d]
    pre = xf @ first.T
    if bias is not None:
        pre = pre + bias[ids].astype(mx.float32)
    h = _activate(pre, activation)
    if glu:
        h = h * (xf @ rows[:, :d].T)
    if threshold > 0:
        h = mx.where(mx.abs(h) <= threshold, 0.0, h)  # NaN stays
    return (h @ rows[:, -d:]).astype(x.dtype)


@lru_cache(maxsize=None)
def _ffn_kernels():
    act = mx.fast.metal_kernel(
        name="flashllm_sparse_ffn_act",
        input_names=["x", "matrix", "bias", "index", "params", "threshold"],
        output_names=["act"],
        header=metal_header(),
        source=metal_source("sparse_ffn_act.metal"),
    )
    down = mx.fast.metal_kernel(
        name="flashllm_sparse_ffn_down",
        input_names=["matrix", "index", "act", "params"],
        output_names=["partial"],
        header=metal_header(),
        source=metal_source("sparse_ffn_down.metal"),
    )
    return act, down


def _sparse_ffn_metal(x, matrix, num_used, bias, activation, glu, index, threshold, d):
    """metal/sparse_ffn_act.metal + sparse_ffn_down.metal per group of 8 tokens, then the sum over chunks."""
    act_kernel, down_kernel = _ffn_kernels()
    n_rows = index.size if index is not None else num_used
    chunks = max(1, min(FFN_MAX_CHUNKS, -(-n_rows // FFN_ROWS_PER_CHUNK)))
    rows_per_chunk = -(-n_rows // chunks)
    placeholder_index = mx.zeros((1,), dtype=mx.int64)
    idx = index if index is not None else placeholder_index
    b = bias if bias is not None else mx.zeros((1,), dtype=matrix.dtype)
    flat = matrix.reshape(-1)
    xf = x.astype(mx.float32)
    outs = []
    for t0 in range(0, x.shape[0], FFN_MAX_TOKENS):
        xs = xf[t0 : t0 + FFN_MAX_TOKENS]
        nt = xs.shape[0]
        template = [("T", matrix.dtype), ("HAS_INDEX", index is not None)]
        (act,) = act_kernel(
            inputs=[
                xs.reshape(-1),
                flat,
                b,
                idx,
                mx.array([n_rows, num_used, d, nt, ACTIVATIONS[activation].code, int(glu)], dtype=mx.int64),
                mx.array([threshold], dtype=mx.float32),
            ],
            template=template + [("HAS_BIAS", bias is not None)],
            grid=(-(-32 * n_rows // METAL_THREADGROUP) * METAL_THREADGROUP, 1, 1),
            threadgroup=(METAL_THREADGROUP, 1, 1),
            output_shapes=[(nt * n_rows,)],
            output_dtypes=[mx.float32],
        )
        (partial,) = down_kernel(
            inputs=[flat, idx, act, mx.array([n_rows, num_used, d, nt, int(glu), rows_per_chunk], dtype=mx.int64)],
            template=template,
            grid=(d, chunks, 1),
            threadgroup=(min(METAL_THREADGROUP, d), 1, 1),
            output_shapes=[(chunks * nt * d,)],
            output_dtypes=[mx.float32],
        )
        outs.append(partial.reshape(chunks, nt, d).sum(axis=0))
    return mx.concatenate(outs).astype(x.dtype)


def sparse_ffn(
    x: mx.array,
    matrix: mx.array,
    num_used: int,
    bias: mx.array | None,
    activation: str,
    glu: bool,
    index: mx.array | None = None,
    threshold: float = 0.0,
) -> mx.array:
    """torch.ops.flashllm.sparse_ffn on mlx arrays (semantics: flashllm_ext/ops/).

    x [T, d]; matrix [capacity, 2d | 3d] of x's dtype, rows [up | gate (GLU) | down]; bias [capacity] or None;
    index int64 [k] of rows below num_used, or None for rows [0, num_used) -> [T, d] of x's dtype.
    """
    d = _check_ffn(x, matrix, num_used, bias, activation, glu, index, threshold)
    n_rows = index.size if index is not None else num_used
    if n_rows == 0 or x.shape[0] == 0 or d == 0:
        return mx.zeros(x.shape, dtype=x.dtype)
    if metal_available():
        return _sparse_ffn_metal(x, matrix, num_used, bias, activation, glu, index, threshold, d)
    return _sparse_ffn_mlx_ops(x, matrix, num_used, bias, activation, glu, index, threshold, d)


# The engine stands on the ops above (its modules import them from this package), so it is imported last.
from flashllm_ext.mlx.ffn import MLXFlashFFN, MLXStreamingFFN  # noqa: E402
from flashllm_ext.mlx.model import load_flash  # noqa: E402
from flashllm_ext.mlx.transfer import MLXTransfer  # noqa: E402
