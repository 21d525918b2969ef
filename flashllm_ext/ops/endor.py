"""endor_decompress and endor_linear: dense rows of, and products with, an Endor tensor (values + 1-bit bitmap).

Each op: schema, checks (worded as the native kernels word them, csrc/common/<op>_checks.h), pure-torch
reference kernel (registered as CompositeExplicitAutograd: every device without a native kernel, the test
oracle and the benchmark baseline), fake kernel, and the typed wrapper library code calls.
"""

from __future__ import annotations


import torch

from flashllm_ext.ops.bits import BITS_VIEW, bitmap_row_counts, unpack_bitmap
from flashllm_ext.ops.library import LIB


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


def _check_endor_tensor_metadata(
    op: str, values: torch.Tensor, bitmap: torch.Tensor, row_offsets: torch.Tensor, n_cols: int
) -> None:
    """The metadata checks of an Endor tensor's arrays every Endor op makes (check_endor_tensor in
    csrc/common/endor_checks.h), after its own check of values' dtype."""
    torch._check(values.dim() == 1, lambda: f"{op}: values must be 1-D, got shape {tuple(values.shape)}")
    torch._check(
        bitmap.dtype == torch.uint8 and bitmap.dim() == 2,
        lambda: f"{op}: bitmap must be a 2-D uint8 tensor, got {bitmap.dtype} of shape {tuple(bitmap.shape)}",
    )
    torch._check(
        n_cols >= 0 and bitmap.shape[1] == (n_cols + 7) // 8,
        lambda: f"{op}: bitmap has {bitmap.shape[1]} bytes per row, n_cols={n_cols} needs {(n_cols + 7) // 8}",
    )
    n_rows = bitmap.shape[0]
    torch._check(
        row_offsets.dtype == torch.int64 and row_offsets.dim() == 1 and row_offsets.numel() == n_rows + 1,
        lambda: (
            f"{op}: row_offsets must be int64 of length rows+1={n_rows + 1}, got "
            f"{row_offsets.dtype} of shape {tuple(row_offsets.shape)}"
        ),
    )
    for name, t in (("bitmap", bitmap), ("row_offsets", row_offsets)):
        torch._check(
            t.device == values.device, lambda: f"{op}: {name} is on {t.device} but values is on {values.device}"
        )


def _check_endor_metadata(
    values: torch.Tensor,
    bitmap: torch.Tensor,
    row_offsets: torch.Tensor,
    n_cols: int,
    rows: torch.Tensor | None,
    out: torch.Tensor | None,
) -> int:
    """The metadata checks of csrc/common/endor_checks.h. Returns the number of output rows."""
    torch._check(
        values.dtype in ENDOR_DTYPES,
        lambda: f"endor_decompress: values must be float32, float16, bfloat16 or int8, got {values.dtype}",
    )
    _check_endor_tensor_metadata("endor_decompress", values, bitmap, row_offsets, n_cols)
    for name, t in (("rows", rows), ("out", out)):
        torch._check(
            t is None or t.device == values.device,
            lambda: f"endor_decompress: {name} is on {t.device} but values is on {values.device}",
        )
    n_out = bitmap.shape[0]
    if rows is not None:
        torch._check(
            rows.dtype == torch.int64 and rows.dim() == 1,
            lambda: f"endor_decompress: rows must be a 1-D int64 tensor, got {rows.dtype} of shape {tuple(rows.shape)}",
        )
        n_out = rows.shape[0]
    if out is not None:
        torch._check(
            out.dtype == values.dtype and tuple(out.shape) == (n_out, n_cols) and out.is_contiguous(),
            lambda: (
                f"endor_decompress: out must be a contiguous {values.dtype} tensor of shape "
                f"{(n_out, n_cols)}, got {out.dtype} of shape {tuple(out.shape)}"
            ),
        )
    return n_out


def _check_endor_tensor_data(
    op: str, values: torch.Tensor, bitmap: torch.Tensor, row_offsets: torch.Tensor, n_cols: int
) -> None:
    """The data checks of an Endor tensor the native kernels make, worded as they word them
    (csrc/common/endor_report.h): row_offsets spans values, then per row, the first bad row raising."""

    def fail(msg: str) -> None:
        raise RuntimeError(f"{op}: {msg}")

    nnz = values.numel()
    if int(row_offsets[0]) != 0 or int(row_offsets[-1]) != nnz:
        fail(
            f"row_offsets must start at 0 and end at values.numel()={nnz}, "
            f"got {int(row_offsets[0])}..{int(row_offsets[-1])}"
        )
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


def check_endor_args(
    values: torch.Tensor,
    bitmap: torch.Tensor,
    row_offsets: torch.Tensor,
    n_cols: int,
    rows: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> int:
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


def _scatter_rows(
    values: torch.Tensor, bitmap: torch.Tensor, starts: torch.Tensor, n_cols: int, out: torch.Tensor
) -> torch.Tensor:
    """Dense rows of checked Endor arrays: each row's values scattered to its set bits. bitmap [K, bytes] and
    starts [K] (each row's first value) of the rows wanted -> out [K, n_cols]. Copies bits, never does math."""
    bits = unpack_bitmap(bitmap, n_cols)
    positions = torch.cumsum(bits, dim=1) - 1 + starts[:, None]
    out.zero_()
    out[bits] = values[positions[bits]]
    return out


def endor_decompress_reference(
    values: torch.Tensor,
    bitmap: torch.Tensor,
    row_offsets: torch.Tensor,
    n_cols: int,
    rows: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
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


def _check_endor_linear_metadata(
    x: torch.Tensor,
    values: torch.Tensor,
    bitmap: torch.Tensor,
    row_offsets: torch.Tensor,
    n_cols: int,
    bias: torch.Tensor | None,
) -> int:
    """The metadata checks of check_endor_linear_args (csrc/common/endor_checks.h). Returns rows."""
    torch._check(
        values.dtype in ENDOR_LINEAR_DTYPES,
        lambda: (
            f"endor_linear: values must be float32, float16 or bfloat16 (int8 is not supported: it "
            f"needs a scale), got {values.dtype}"
        ),
    )
    torch._check(
        x.dim() == 2 and x.dtype in (values.dtype, torch.float32),
        lambda: (
            f"endor_linear: x must be a 2-D {values.dtype} or float32 tensor [T, n_cols], got "
            f"{x.dtype} of shape {tuple(x.shape)}"
        ),
    )
    _check_endor_tensor_metadata("endor_linear", values, bitmap, row_offsets, n_cols)
    torch._check(
        x.shape[1] == n_cols, lambda: f"endor_linear: x has {x.shape[1]} columns but the weight has n_cols={n_cols}"
    )
    n_rows = bitmap.shape[0]
    for name, t in (("x", x), ("bias", bias)):
        torch._check(
            t is None or t.device == values.device,
            lambda: f"endor_linear: {name} is on {t.device} but values is on {values.device}",
        )
    torch._check(
        bias is None or (bias.dtype == x.dtype and bias.dim() == 1 and bias.shape[0] == n_rows),
        lambda: (
            f"endor_linear: bias must be {x.dtype} of shape [rows={n_rows}], got {bias.dtype} of "
            f"shape {tuple(bias.shape)}"
        ),
    )
    return n_rows


def endor_linear_reference(
    x: torch.Tensor,
    values: torch.Tensor,
    bitmap: torch.Tensor,
    row_offsets: torch.Tensor,
    n_cols: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
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


def endor_decompress(
    values: torch.Tensor,
    bitmap: torch.Tensor,
    row_offsets: torch.Tensor,
    *,
    n_cols: int,
    rows: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense rows of an Endor tensor (docs/design.md §5), bit for bit.

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


def endor_linear(
    x: torch.Tensor,
    values: torch.Tensor,
    bitmap: torch.Tensor,
    row_offsets: torch.Tensor,
    *,
    n_cols: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T (+ bias) straight from an Endor tensor W [R, n_cols] (docs/design.md §5), never materialising W.

    x: [T, n_cols] of values.dtype or float32 (any strides); T = 1..8 is the decode case it is built for
    values: [nnz] float32 | float16 | bfloat16 (int8 is refused: it would need a scale)
    bitmap: uint8 [R, ceil(n_cols/8)]; row_offsets: int64 [R + 1], as endor_decompress takes them
    bias: [R] of x.dtype; None for none
    Returns y: [T, R] of x.dtype, accumulated in float32. Raises RuntimeError naming the bad row (CUDA: with kernel
    checks on; without them a bad row comes out as zeros, common/kernel_checks.h).
    """
    return torch.ops.flashllm.endor_linear.default(x, values, bitmap, row_offsets, n_cols, bias)
