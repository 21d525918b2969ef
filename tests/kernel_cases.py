"""Endor inputs for the kernel tests of endor_decompress and endor_linear (CPU kernel, SIMT-emulated CUDA and Metal
bodies, MLX backend, real GPU), built on the CPU kernel's test helpers so every backend sees the same weights and the
same bad inputs."""

from __future__ import annotations

import torch

from flashllm_ext import endor
from flashllm_ext.ops.bits import BITS_VIEW
from test_endor_decompress import DTYPES, _bad_cases, assert_bitwise_equal, make_weight

__all__ = [
    "BAD_CASES",
    "BAD_LINEAR_CASES",
    "DTYPES",
    "LINEAR_DTYPES",
    "SHAPES",
    "assert_bitwise_equal",
    "endor_case",
    "linear_case",
]

# (rows, cols): single element, single row/column, odd sizes, rows whose byte offset is and is not a multiple of
# 16 for each width, rows longer than one warp step (256 columns) and than one CUDA iteration (1024 columns).
# Small: the emulation runs every GPU thread as an OS thread.
SHAPES = ((1, 1), (1, 37), (19, 1), (7, 13), (5, 64), (6, 24), (3, 300), (2, 1100))
# (expected message, (values, bitmap, row_offsets, n_cols, rows)): the bad inputs every kernel must refuse.
BAD_CASES = list(_bad_cases())


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
    for expected, (v, b, o, n_cols, rows) in _bad_cases():
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
