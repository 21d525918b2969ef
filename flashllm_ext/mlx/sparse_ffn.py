"""The sparse FFN op on mlx arrays: sparse_ffn (semantics: flashllm_ext/ops/ffn.py), Metal kernels on Apple
Silicon and mlx ops elsewhere, raising the torch kernels' RuntimeError messages."""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from flashllm_ext.mlx import metal
from flashllm_ext.mlx.metal import metal_source
from flashllm_ext.ops import ACTIVATIONS
from flashllm_ext.ops.blocks import BLOCK, BundleFormat, block_format, n_blocks
from flashllm_ext.ops.constants import (
    FFN_MAX_CHUNKS,
    FFN_MAX_TOKENS,
    FFN_ROWS_PER_CHUNK,
    METAL_THREADGROUP,
    metal_header,
)


_FFN_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# Launch geometry of metal/sparse_ffn_*.metal (csrc/common/ffn_grid.h, mirrored in flashllm_ext.ops.constants).


def _check_x(op: str, x: mx.array) -> int:
    """x [T, d] of a float dtype; returns d."""
    if x.dtype not in _FFN_DTYPES or x.ndim != 2:
        raise RuntimeError(
            f"{op}: x must be a 2-D float32/float16/bfloat16 tensor [T, d], got {x.dtype} of shape {tuple(x.shape)}"
        )
    return x.shape[1]


def _check_rows_args(
    op: str,
    x: mx.array,
    matrix: mx.array,
    num_used: int,
    bias: mx.array | None,
    activation: str,
    index: mx.array | None,
    threshold: float,
) -> None:
    """Every check but x's and the matrix's dtype and width (the op's own): csrc/common/sparse_ffn_checks.h's, plus
    the index range."""
    if not 0 <= num_used <= matrix.shape[0]:
        raise RuntimeError(f"{op}: num_used={num_used} is outside [0, capacity={matrix.shape[0]}]")
    if activation not in ACTIVATIONS:
        raise RuntimeError(f"{op}: activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    if not threshold >= 0 or threshold == float("inf"):
        raise RuntimeError(f"{op}: threshold must be finite and >= 0, got {threshold}")
    if bias is not None and (bias.dtype != x.dtype or bias.ndim != 1 or bias.shape[0] != matrix.shape[0]):
        raise RuntimeError(
            f"{op}: bias must be {x.dtype} of shape [capacity={matrix.shape[0]}], got {bias.dtype} of shape "
            f"{tuple(bias.shape)}"
        )
    if index is not None:
        if index.dtype != mx.int64 or index.ndim != 1:
            raise RuntimeError(
                f"{op}: index must be a 1-D int64 tensor, got {index.dtype} of shape {tuple(index.shape)}"
            )
        bad = (index < 0) | (index >= num_used)
        if index.size and bool(mx.any(bad).item()):
            k = int(mx.argmax(bad).item())
            raise RuntimeError(f"{op}: index[{k}]={int(index[k].item())} is outside [0, num_used={num_used})")


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
    """sparse_ffn's checks. Returns d."""
    d = _check_x("sparse_ffn", x)
    width = (3 if glu else 2) * d
    if matrix.dtype != x.dtype or matrix.ndim != 2 or matrix.shape[1] != width:
        raise RuntimeError(
            f"sparse_ffn: matrix must be {x.dtype} of shape [capacity, {width}], got {matrix.dtype} of shape "
            f"{tuple(matrix.shape)}"
        )
    _check_rows_args("sparse_ffn", x, matrix, num_used, bias, activation, index, threshold)
    return d


def activate(pre: mx.array, activation: str) -> mx.array:
    if activation == "relu":
        return mx.maximum(pre, 0)
    if activation == "silu":
        return pre * mx.sigmoid(pre)
    if activation == "gelu_tanh":
        return 0.5 * pre * (1 + mx.tanh(0.7978845608028654 * (pre + 0.044715 * pre**3)))
    return 0.5 * pre * (1 + mx.erf(pre * 0.7071067811865476))


def _sparse_ffn_mlx_ops(x, matrix, num_used, bias, activation, glu, index, threshold, d):
    """Fallback with mlx ops, float32: gather the rows, two matmuls."""
    ids = index if index is not None else mx.arange(num_used)
    rows = matrix[ids].astype(mx.float32)
    return _ffn_of_rows(x.astype(mx.float32), rows, bias, ids, activation, glu, threshold, d).astype(x.dtype)


def _ffn_of_rows(xf, rows, bias, ids, activation, glu, threshold, d):
    """The FFN of xf [T, d] float32 over float32 bundle rows [k, 2d | 3d] (bias[ids] theirs): [T, d] float32."""
    first = rows[:, d : 2 * d] if glu else rows[:, :d]
    pre = xf @ first.T
    if bias is not None:
        pre = pre + bias[ids].astype(mx.float32)
    h = activate(pre, activation)
    if glu:
        h = h * (xf @ rows[:, :d].T)
    if threshold > 0:
        h = mx.where(mx.abs(h) <= threshold, 0.0, h)  # NaN stays
    return h @ rows[:, -d:]


def _ffn_header() -> str:
    """What the FFN bodies' header holds: the constants, the activation, the block reads."""
    return metal_header() + metal_source("activation.metal") + metal_source("blocks.metal")


def _kernel(body: str, inputs: list[str], outputs: list[str]):
    """The mx.fast.metal_kernel of `metal/<body>.metal` with the FFN bodies' header."""
    return mx.fast.metal_kernel(
        name=f"flashllm_{body}",
        input_names=inputs,
        output_names=outputs,
        header=_ffn_header(),
        source=metal_source(f"{body}.metal"),
    )


@lru_cache(maxsize=None)
def _ffn_kernels():
    return (
        _kernel("sparse_ffn_act", ["x", "matrix", "bias", "index", "params", "threshold"], ["act"]),
        _kernel("sparse_ffn_down", ["matrix", "index", "act", "params"], ["partial"]),
    )


@lru_cache(maxsize=None)
def _quantized_ffn_kernels():
    act_inputs = ["codes", "scale", "scaled_sum", "matrix", "bias", "index", "params", "threshold"]
    return (
        _kernel("quantize_x_blocks", ["x", "params"], ["codes", "scale", "scaled_sum"]),
        _kernel("quantized_sparse_ffn_act", act_inputs, ["act"]),
        _kernel("quantized_sparse_ffn_down", ["matrix", "index", "act", "params"], ["partial"]),
    )


def _chunking(n_rows: int) -> tuple[int, int]:
    """(chunks, rows per chunk) of the down kernels (csrc/common/ffn_grid.h ffn_grid)."""
    chunks = max(1, min(FFN_MAX_CHUNKS, -(-n_rows // FFN_ROWS_PER_CHUNK)))
    return chunks, -(-n_rows // chunks)


def _activations(kernel, inputs: list, template: list, n_rows: int, nt: int) -> mx.array:
    """An act kernel over a simdgroup per row (whole threadgroups) -> act [nt * n_rows] float32."""
    (act,) = kernel(
        inputs=inputs,
        template=template,
        grid=(-(-32 * n_rows // METAL_THREADGROUP) * METAL_THREADGROUP, 1, 1),
        threadgroup=(METAL_THREADGROUP, 1, 1),
        output_shapes=[(nt * n_rows,)],
        output_dtypes=[mx.float32],
    )
    return act


def _summed_down(kernel, inputs: list, template: list, d: int, chunks: int, nt: int) -> mx.array:
    """A down kernel over (d, chunks) threads, its partial sums summed over the chunks -> [nt, d] float32."""
    (partial,) = kernel(
        inputs=inputs,
        template=template,
        grid=(d, chunks, 1),
        threadgroup=(min(METAL_THREADGROUP, d), 1, 1),
        output_shapes=[(chunks * nt * d,)],
        output_dtypes=[mx.float32],
    )
    return partial.reshape(chunks, nt, d).sum(axis=0)


def _sparse_ffn_metal(x, matrix, num_used, bias, activation, glu, index, threshold, d):
    """metal/sparse_ffn_act.metal + sparse_ffn_down.metal per group of 8 tokens, then the sum over chunks."""
    act_kernel, down_kernel = _ffn_kernels()
    n_rows = index.size if index is not None else num_used
    chunks, rows_per_chunk = _chunking(n_rows)
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
        act = _activations(
            act_kernel,
            [
                xs.reshape(-1),
                flat,
                b,
                idx,
                mx.array([n_rows, num_used, d, nt, ACTIVATIONS[activation].code, int(glu)], dtype=mx.int64),
                mx.array([threshold], dtype=mx.float32),
            ],
            template + [("HAS_BIAS", bias is not None)],
            n_rows,
            nt,
        )
        down_params = mx.array([n_rows, num_used, d, nt, int(glu), rows_per_chunk], dtype=mx.int64)
        outs.append(_summed_down(down_kernel, [flat, idx, act, down_params], template, d, chunks, nt))
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
    if metal.metal_available():
        return _sparse_ffn_metal(x, matrix, num_used, bias, activation, glu, index, threshold, d)
    return _sparse_ffn_mlx_ops(x, matrix, num_used, bias, activation, glu, index, threshold, d)


def dequantize_blocks(codes: mx.array, fmt: str, d: int) -> mx.array:
    """flashllm_ext.ops.blocks.dequantize_rows on mx.arrays: rows of `fmt` blocks uint8 [R, row bytes] -> float32
    [R, d] (d * q, d * (q - 8), d * q + m)."""
    f = block_format(fmt)
    rows, nb = codes.shape[0], n_blocks(d)
    blocks = codes.reshape(rows, nb, f.block_bytes)
    scale = mx.view(blocks[..., 0:2], mx.float16).astype(mx.float32)
    if f.bits == 8:
        w = mx.view(blocks[..., 2:], mx.int8).astype(mx.float32) * scale
    else:
        packed = blocks[..., 4 if f.has_min else 2 :]
        q = mx.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(mx.float32)
        w = scale * q + mx.view(blocks[..., 2:4], mx.float16).astype(mx.float32) if f.has_min else scale * (q - 8)
    return w.reshape(rows, nb * BLOCK)[:, :d]


def round_x_blocks(x: mx.array) -> mx.array:
    """x [T, d] as the quantized kernels see it, float32: per block of 32 columns rounded to int8 codes times the
    block's scale max|x| / 127 (flashllm_ext.ops.blocks.quantize_x_blocks: round half away from zero)."""
    t, d = x.shape
    nb = n_blocks(d)
    blocks = mx.pad(x.astype(mx.float32), [(0, 0), (0, nb * BLOCK - d)]).reshape(t, nb, BLOCK)
    scale = mx.max(mx.abs(blocks), axis=-1, keepdims=True) / 127
    inv = mx.where(scale == 0, 0.0, 1 / mx.where(scale == 0, 1.0, scale))
    v = blocks * inv
    a = mx.abs(v)
    floored = mx.floor(a)
    codes = mx.sign(v) * (floored + mx.floor(2 * (a - floored)))  # ggml's exact round half away from zero
    return (codes * scale).reshape(t, nb * BLOCK)[:, :d]


def quantized_sparse_ffn(
    x: mx.array,
    matrix: mx.array,
    num_used: int,
    bias: mx.array | None,
    activation: str,
    glu: bool,
    bundle_format: str,
    index: mx.array | None = None,
    threshold: float = 0.0,
) -> mx.array:
    """torch.ops.flashllm.quantized_sparse_ffn on mlx arrays, as its pure-torch reference computes it
    (flashllm_ext/ops/ffn.py): x quantized per block of 32 columns, integer dot products per block with the input
    columns, the down rows dequantized. Metal kernels on Apple Silicon; elsewhere mlx ops on the dequantized rows.

    x [T, d]; matrix uint8 [capacity, BundleFormat.parse(bundle_format).row_bytes(d, glu)], rows [up | gate (GLU)
    | down] in GGUF blocks; bias, index, threshold as sparse_ffn's -> [T, d] of x's dtype.
    """
    op = "quantized_sparse_ffn"
    d = _check_x(op, x)
    try:
        layout = BundleFormat.parse(bundle_format)
    except ValueError:
        raise RuntimeError(f"{op}: bundle_format must be '<in format>+<down format>', got {bundle_format!r}") from None
    width = layout.row_bytes(d, glu)
    if matrix.dtype != mx.uint8 or matrix.ndim != 2 or matrix.shape[1] != width:
        raise RuntimeError(
            f"{op}: matrix must be uint8 of shape [capacity, {width}] ({bundle_format} bundles of d={d}, glu={glu}), "
            f"got {matrix.dtype} of shape {tuple(matrix.shape)}"
        )
    _check_rows_args(op, x, matrix, num_used, bias, activation, index, threshold)
    ids = index if index is not None else mx.arange(num_used)
    if ids.size == 0 or x.shape[0] == 0 or d == 0:
        return mx.zeros(x.shape, dtype=x.dtype)
    if metal.metal_available():
        return _quantized_sparse_ffn_metal(x, matrix, num_used, bias, activation, glu, layout, index, threshold, d)
    codes = matrix[ids]
    col, _ = layout.part_bytes(d)
    n_in = 2 if glu else 1
    parts = [dequantize_blocks(codes[:, k * col : (k + 1) * col], layout.in_format, d) for k in range(n_in)]
    rows = mx.concatenate(parts + [dequantize_blocks(codes[:, n_in * col :], layout.down_format, d)], axis=1)
    return _ffn_of_rows(round_x_blocks(x), rows, bias, ids, activation, glu, threshold, d).astype(x.dtype)


def _quantized_sparse_ffn_metal(x, matrix, num_used, bias, activation, glu, layout, index, threshold, d):
    """metal/quantize_x_blocks.metal over every token, then metal/quantized_sparse_ffn_act.metal + _down.metal per
    group of 8 tokens, then the sum over chunks."""
    quantize, act_kernel, down_kernel = _quantized_ffn_kernels()
    n_tok, nb = x.shape[0], n_blocks(d)
    n_rows = index.size if index is not None else num_used
    chunks, rows_per_chunk = _chunking(n_rows)
    col, _ = layout.part_bytes(d)
    row_bytes = matrix.shape[1]
    codes, scale, scaled_sum = quantize(
        inputs=[x.astype(mx.float32).reshape(-1), mx.array([n_tok, d, nb], dtype=mx.int64)],
        grid=(-(-32 * n_tok * nb // METAL_THREADGROUP) * METAL_THREADGROUP, 1, 1),
        threadgroup=(METAL_THREADGROUP, 1, 1),
        output_shapes=[(n_tok * nb * BLOCK,), (n_tok * nb,), (n_tok * nb,)],
        output_dtypes=[mx.int8, mx.float32, mx.float32],
    )
    idx = index if index is not None else mx.zeros((1,), dtype=mx.int64)
    b = bias if bias is not None else mx.zeros((1,), dtype=x.dtype)
    flat = matrix.reshape(-1)
    in_code, down_code = block_format(layout.in_format).code, block_format(layout.down_format).code
    outs = []
    for t0 in range(0, n_tok, FFN_MAX_TOKENS):
        nt = min(FFN_MAX_TOKENS, n_tok - t0)
        blocks = slice(t0 * nb, (t0 + nt) * nb)
        act = _activations(
            act_kernel,
            [
                codes[t0 * nb * BLOCK : (t0 + nt) * nb * BLOCK],
                scale[blocks],
                scaled_sum[blocks],
                flat,
                b,
                idx,
                mx.array(
                    [n_rows, num_used, d, nt, ACTIVATIONS[activation].code, int(glu), row_bytes, col],
                    dtype=mx.int64,
                ),
                mx.array([threshold], dtype=mx.float32),
            ],
            [("T", x.dtype), ("IN_FMT", in_code), ("HAS_INDEX", index is not None), ("HAS_BIAS", bias is not None)],
            n_rows,
            nt,
        )
        down_params = mx.array(
            [n_rows, num_used, d, nt, rows_per_chunk, row_bytes, (2 if glu else 1) * col], dtype=mx.int64
        )
        down_template = [("DOWN_FMT", down_code), ("HAS_INDEX", index is not None)]
        outs.append(_summed_down(down_kernel, [flat, idx, act, down_params], down_template, d, chunks, nt))
    return mx.concatenate(outs).astype(x.dtype)
