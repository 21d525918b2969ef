"""Endor test matrices shared by the GPU-kernel tests (SIMT-emulated CUDA and Metal bodies, MLX backend).

Values are random bit patterns (so NaNs with payloads appear), with -0.0, +-inf, a NaN payload and the smallest
subnormal planted in every float matrix of mixed density, one all-zero row and one all-non-zero row where the
shape allows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flashllm_ext import endor

# Integer view of each dtype: kernels and comparisons work on bits.
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.int8: torch.int8}
DTYPES = tuple(BITS)
# -0.0, +inf, -inf, a NaN with a payload, the smallest positive subnormal, as bit patterns.
SPECIAL_BITS = {
    torch.float32: (-0x80000000, 0x7F800000, -0x00800000, 0x7FC00001, 0x00000001),
    torch.float16: (-0x8000, 0x7C00, -0x0400, 0x7E01, 0x0001),
    torch.bfloat16: (-0x8000, 0x7F80, -0x0080, 0x7FC1, 0x0001),
}
# (rows, cols): single element, single row/column, odd sizes, rows whose byte offset is and is not a multiple of
# 16 for each width, rows longer than one warp step (256 columns) and than one CUDA iteration (1024 columns).
SHAPES = ((1, 1), (1, 37), (19, 1), (7, 13), (5, 64), (6, 24), (3, 300), (2, 1100))


@dataclass
class Case:
    dense: torch.Tensor
    values: torch.Tensor
    bitmap: torch.Tensor
    row_offsets: torch.Tensor

    @property
    def n_cols(self) -> int:
        return self.dense.shape[1]

    @property
    def n_rows(self) -> int:
        return self.dense.shape[0]


def make_case(shape: tuple[int, int], dtype: torch.dtype, seed: int = 0, density: float = 0.5) -> Case:
    """A random sparse matrix of `shape` (bits drawn uniformly) and its Endor arrays from endor.compress."""
    gen = torch.Generator().manual_seed(seed)
    bits_dtype = BITS[dtype]
    info = torch.iinfo(bits_dtype)
    bits = torch.randint(info.min, info.max + 1, shape, generator=gen, dtype=torch.int64).to(bits_dtype)
    keep = torch.rand(shape, generator=gen) < density
    rows, cols = shape
    mixed = 0.0 < density < 1.0
    for i, pattern in enumerate(SPECIAL_BITS.get(dtype, ()) if mixed else ()):
        r, c = (rows - 1 - i) % rows, (3 * i) % cols
        bits[r, c], keep[r, c] = pattern, True
    if mixed and rows >= 3:
        keep[0] = False
        keep[1] = True
    zero, one = torch.zeros((), dtype=bits_dtype), torch.ones((), dtype=bits_dtype)
    bits = torch.where(keep, torch.where(bits == 0, one, bits), zero)  # kept elements are non-zero bit patterns
    dense = bits.view(dtype)
    t = endor.compress(dense)
    return Case(dense, t.values, t.bitmap, t.row_offsets)


def with_padding_bits(case: Case) -> Case:
    """The same matrix with every padding bit past n_cols set, and one junk value per padded row appended to its
    row (the reference accepts this: counts include padding bits, their values are never written out)."""
    n_cols = case.n_cols
    assert n_cols % 8, "needs a shape with padding bits"
    pad = (0xFF << (n_cols % 8)) & 0xFF
    bitmap = case.bitmap.clone()
    bitmap[:, -1] |= pad
    pieces, offsets = [], [0]
    for r in range(case.n_rows):
        row = case.values[case.row_offsets[r]:case.row_offsets[r + 1]]
        junk_row = torch.full((pad.bit_count(),), 0x55, dtype=BITS[case.dense.dtype]).view(case.dense.dtype)
        pieces += [row, junk_row]
        offsets.append(offsets[-1] + row.numel() + junk_row.numel())
    return Case(case.dense, torch.cat(pieces), bitmap, torch.tensor(offsets, dtype=torch.int64))


def corrupt(kind: str) -> tuple:
    """Arguments (values, bitmap, row_offsets, n_cols, rows) of a 7x13 fp32 matrix with one defect `kind`."""
    case = make_case((7, 13), torch.float32, seed=11)
    values, bitmap, offsets = case.values, case.bitmap, case.row_offsets.clone()
    rows = None
    if kind == "count":
        offsets[3] += 1  # row 2 one longer than its bitmap, row 3 one shorter
    elif kind == "non_monotone":
        offsets[4] = offsets[3] - 1
    elif kind == "negative":
        offsets[0] = -1
    elif kind == "short":
        values = values[:-1]
    elif kind in ("row_high", "row_negative"):
        rows = torch.tensor([0, 7 if kind == "row_high" else -1, 2])
    return values, bitmap, offsets, 13, rows


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and -0.0 included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))
