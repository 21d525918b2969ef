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
