"""Bit-level facts shared by the Endor format, its kernels, its tests and the predictor's activation bitmaps.

Packed bitmaps (docs/design.md §5): uint8 [rows, ceil(cols/8)], each row starting on a byte, little bit order (bit j of
byte b is column 8*b + j), as `numpy.packbits(mask, axis=-1, bitorder="little")`.
"""

from __future__ import annotations

import torch

# The integer type of the same width as each element type Endor stores. Its kernels copy bits, never values, so
# they move every element type through this view; "non-zero" means a non-zero bit pattern (-0.0 and NaN payloads
# survive), and bitwise comparisons in tests go through it too (NaN != NaN as floats).
BITS_VIEW = {
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.int8: torch.int8,
}

_POPCOUNT_LUT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int64)
_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


def pack_bitmap(mask: torch.Tensor) -> torch.Tensor:
    """Pack a boolean mask. mask: bool [rows, cols] -> uint8 [rows, ceil(cols/8)]."""
    rows, cols = mask.shape
    padded = torch.zeros((rows, (cols + 7) // 8 * 8), dtype=torch.uint8, device=mask.device)
    padded[:, :cols] = mask
    weights = 1 << torch.arange(8, dtype=torch.int32, device=mask.device)
    return (padded.view(rows, (cols + 7) // 8, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8)


def unpack_bitmap(bitmap: torch.Tensor, n_cols: int) -> torch.Tensor:
    """Unpack a bitmap, dropping the padding bits. bitmap: uint8 [rows, ceil(n_cols/8)] -> bool [rows, n_cols]."""
    bits = (bitmap.unsqueeze(-1) >> _BIT_SHIFTS.to(bitmap.device)) & 1
    return bits.reshape(bitmap.shape[0], -1)[:, :n_cols].bool()


def bitmap_row_counts(bitmap: torch.Tensor) -> torch.Tensor:
    """Set bits (popcount) of each row. bitmap: uint8 [rows, bytes] -> int64 [rows]."""
    return _POPCOUNT_LUT.to(bitmap.device)[bitmap.long()].sum(dim=1)
