"""Endor inputs for the kernel tests of endor_decompress and endor_linear (CPU kernel, SIMT-emulated CUDA and Metal
bodies, MLX backend, real GPU), so every backend sees the same weights and the same bad inputs."""

from __future__ import annotations

import torch

from flashllm_ext import endor
from flashllm_ext.ops import ENDOR_DTYPES
from flashllm_ext.ops.bits import BITS_VIEW

__all__ = [
    "BAD_CASES",
    "BAD_LINEAR_CASES",
    "DTYPES",
    "LINEAR_DTYPES",
    "SHAPES",
    "assert_bitwise_equal",
    "bad_decompress_cases",
    "endor_arrays",
    "endor_case",
    "linear_case",
    "make_weight",
]

DTYPES = list(ENDOR_DTYPES)
SPECIAL_BITS = {  # -0.0, NaN with payload, +inf, -inf, smallest subnormal, largest subnormal
    torch.float32: [-(2**31), 0x7FC12345, 0x7F800000, -8388608, 1, 0x007FFFFF],
    torch.float16: [-(2**15), 0x7E01, 0x7C00, -1024, 1, 0x03FF],
    torch.bfloat16: [-(2**15), 0x7FC1, 0x7F80, -128, 1, 0x007F],
    torch.int8: [-128, 127, 1, -1],
}


def make_weight(shape, dtype, density=0.5, seed=0):
    """Random bit patterns (so every value is exercised, specials included), zeroed at random."""
    g = torch.Generator().manual_seed(seed)
    itype = BITS_VIEW[dtype]
    info = torch.iinfo(itype)
    bits = torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(itype)
    specials = torch.tensor(SPECIAL_BITS[dtype], dtype=torch.int64).to(itype)
    flat = bits.view(-1)
    n = min(flat.numel(), len(specials))
    flat[torch.randperm(flat.numel(), generator=g)[:n]] = specials[:n]
    bits[torch.rand(shape, generator=g) >= density] = 0
    return bits.view(dtype)


def assert_bitwise_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(BITS_VIEW[a.dtype]), b.view(BITS_VIEW[b.dtype]))


def endor_arrays():
    """(values, bitmap, row_offsets) of a random 6 x 20 float16 weight's Endor form, each its own copy."""
    w = make_weight((6, 20), torch.float16, 0.5)
    e = endor.compress(w)
    return e.values.clone(), e.bitmap.clone(), e.row_offsets.clone()


def bad_decompress_cases():
    """(expected message, (values, bitmap, row_offsets, n_cols, rows)): the bad inputs endor_decompress refuses."""
    v, b, o = endor_arrays()
    yield "bitmap has 2 bytes per row", (v, b[:, :2], o, 20, None)
    yield "bitmap must be a 2-D uint8", (v, b.to(torch.int16), o, 20, None)
    yield "values must be float32, float16, bfloat16 or int8, got", (v.to(torch.float64), b, o, 20, None)
    yield "values must be 1-D", (v.view(1, -1), b, o, 20, None)
    yield "row_offsets must be int64", (v, b, o.to(torch.int32), 20, None)
    yield "row_offsets must be int64 of length", (v, b, o[:-1], 20, None)
    yield r"row_offsets must start at 0 and end at values.numel\(\)=\d+", (v[:-3], b, o, 20, None)  # values too short
    o2 = o.clone()
    o2[2], o2[3] = o[3], o[2]  # not monotone: row 1 spans rows 1 and 2, row 2 ends before it starts
    yield r"row 1: row_offsets says \d+ values but the bitmap has \d+ set bits", (v, b, o2, 20, None)
    o3 = o.clone()
    o3[1] += 1  # disagrees with the popcounts of rows 0 and 1
    yield r"row 0: row_offsets says \d+ values but the bitmap has \d+ set bits", (v, b, o3, 20, None)
    b2 = b.clone()
    b2[4, 0] ^= 1  # one bit flipped: counts disagree
    yield r"row 4: row_offsets says \d+ values but the bitmap has \d+ set bits", (v, b2, o, 20, None)
    b3 = b.clone()
    b3[0, -1] |= 0x80  # padding bit past n_cols
    yield "row 0: bitmap has bits set past n_cols=20", (v, b3, o, 20, None)
    yield r"rows\[1\]=6 is outside \[0, 6\)", (v, b, o, 20, torch.tensor([0, 6]))
    yield r"rows\[0\]=-1 is outside \[0, 6\)", (v, b, o, 20, torch.tensor([-1]))
    yield "rows must be a 1-D int64", (v, b, o, 20, torch.tensor([0.0]))


# (rows, cols): single element, single row/column, odd sizes, rows whose byte offset is and is not a multiple of
# 16 for each width, rows longer than one warp step (256 columns) and than one CUDA iteration (1024 columns).
# Small: the emulation runs every GPU thread as an OS thread.
SHAPES = ((1, 1), (1, 37), (19, 1), (7, 13), (5, 64), (6, 24), (3, 300), (2, 1100))
# (expected message, (values, bitmap, row_offsets, n_cols, rows)): the bad inputs every kernel must refuse.
BAD_CASES = list(bad_decompress_cases())


def endor_case(
    shape: tuple[int, int], dtype: torch.dtype, seed: int = 0, density: float = 0.5
) -> tuple[torch.Tensor, endor.EndorTensor]:
    """A random sparse weight (specials planted by make_weight) and its Endor form. At mixed density with 3+ rows,
    row 0 is all zeros and row 1 has no zero."""
    w = make_weight(shape, dtype, density, seed)
    if 0.0 < density < 1.0 and shape[0] >= 3:
        bits = w.view(BITS_VIEW[dtype])
        bits[0] = 0
        bits[1] = torch.where(bits[1] == 0, torch.ones_like(bits[1]), bits[1])
    return w, endor.compress(w)


# ---- endor_linear ---------------------------------------------------------------------------------------------
LINEAR_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def linear_case(
    n_tok: int,
    shape: tuple[int, int],
    dtype: torch.dtype,
    x_dtype: torch.dtype | None = None,
    seed: int = 0,
    density: float = 0.5,
    bias: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, endor.EndorTensor, torch.Tensor | None]:
    """(x [T, cols], dense weight [rows, cols], its Endor form, bias [rows] or None).

    Every value is a multiple of 1/4 in [-4, 4], so every product and partial sum is exact in float32 (at the sizes
    tested): any summation order gives the reference's float32 result, and the output cast rounds it alike, so
    kernels compare exactly. At mixed density with 3+ rows, row 0 is all zeros and row 1 has no zero.
    """
    g = torch.Generator().manual_seed(seed)
    x_dtype = x_dtype or dtype
    quarters = lambda *size: torch.randint(-16, 17, size, generator=g).float() / 4  # noqa: E731
    w = quarters(*shape)
    w[torch.rand(shape, generator=g) >= density] = 0
    if 0.0 < density < 1.0 and shape[0] >= 3:
        w[0] = 0
        w[1] = torch.where(w[1] == 0, torch.ones_like(w[1]), w[1])
    w = w.to(dtype)
    b = quarters(shape[0]).to(x_dtype) if bias else None
    return quarters(n_tok, shape[1]).to(x_dtype), w, endor.compress(w), b


def _bad_linear_cases():
    """(expected message, (x, values, bitmap, row_offsets, n_cols, bias)): what every endor_linear kernel refuses.
    The Endor-tensor cases are endor_decompress's (the same checks, named for this op)."""
    for expected, (v, b, o, n_cols, rows) in bad_decompress_cases():
        if rows is None and "values must be float32" not in expected:
            yield "endor_linear: " + expected, (torch.ones(2, n_cols, dtype=v.dtype), v, b, o, n_cols, None)
    x, w, e, bias = linear_case(3, (6, 20), torch.float16)
    args = (e.values, e.bitmap, e.row_offsets, 20)
    yield (
        "values must be float32, float16 or bfloat16 \\(int8 is not supported",
        (x.to(torch.int8), e.values.to(torch.int8), *args[1:], None),
    )
    yield "values must be float32, float16 or bfloat16", (x, e.values.double(), *args[1:], None)
    # dtypes print as torch.float16 from Python, Half from C++
    yield r"x must be a 2-D \S+ or float32 tensor \[T, n_cols\]", (x.to(torch.bfloat16), *args, None)
    yield r"x must be a 2-D \S+ or float32 tensor \[T, n_cols\]", (x[0], *args, None)
    yield "x has 19 columns but the weight has n_cols=20", (x[:, :19], *args, None)
    yield r"bias must be \S+ of shape \[rows=6\]", (x, *args, bias[:5])
    yield r"bias must be \S+ of shape \[rows=6\]", (x.float(), *args, bias)


BAD_LINEAR_CASES = list(_bad_linear_cases())
