"""Endor inputs for the GPU-kernel tests (SIMT-emulated CUDA and Metal bodies, MLX backend), built on the CPU
kernel's test helpers so every backend sees the same weights and the same bad inputs."""
from __future__ import annotations

import torch

from flashllm_ext import endor
from flashllm_ext.bits import BITS_VIEW
from test_endor_decompress import DTYPES, _bad_cases, assert_bitwise_equal, make_weight

__all__ = ["BAD_CASES", "DTYPES", "SHAPES", "assert_bitwise_equal", "endor_case"]

# (rows, cols): single element, single row/column, odd sizes, rows whose byte offset is and is not a multiple of
# 16 for each width, rows longer than one warp step (256 columns) and than one CUDA iteration (1024 columns).
# Small: the emulation runs every GPU thread as an OS thread.
SHAPES = ((1, 1), (1, 37), (19, 1), (7, 13), (5, 64), (6, 24), (3, 300), (2, 1100))
# (expected message, (values, bitmap, row_offsets, n_cols, rows)): the bad inputs every kernel must refuse.
BAD_CASES = list(_bad_cases())


def endor_case(shape: tuple[int, int], dtype: torch.dtype, seed: int = 0,
               density: float = 0.5) -> tuple[torch.Tensor, endor.EndorTensor]:
    """A random sparse weight (specials planted by make_weight) and its Endor form. At mixed density with 3+ rows,
    row 0 is all zeros and row 1 has no zero."""
    w = make_weight(shape, dtype, density, seed)
    if 0.0 < density < 1.0 and shape[0] >= 3:
        bits = w.view(BITS_VIEW[dtype])
        bits[0] = 0
        bits[1] = torch.where(bits[1] == 0, torch.ones_like(bits[1]), bits[1])
    return w, endor.compress(w)
