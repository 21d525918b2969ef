"""The MLX backend (flashllm_ext.mlx): its mlx-op fallback everywhere and, on Apple Silicon, its Metal kernel
(metal/endor_decompress.metal), against the torch reference, bitwise. Off Apple Silicon the Metal kernel body is
tested through the SIMT emulation in tests/ops/test_simt.py.
"""

from __future__ import annotations

import pytest
import torch

from flashllm_ext.ops import endor_decompress_reference
from tests.helpers.kernel_cases import BAD_CASES, DTYPES, SHAPES, assert_bitwise_equal, endor_case
from tests.helpers.mlx_arrays import path, to_mx, to_torch  # noqa: F401  (path: the fallback and, where it exists, Metal)

mx = pytest.importorskip("mlx.core", reason="mlx is not importable (install the [mlx] extra)")
fmlx = pytest.importorskip("flashllm_ext.mlx")


def decompress(values, bitmap, row_offsets, n_cols, rows=None) -> torch.Tensor:
    out = fmlx.endor_decompress(
        to_mx(values), to_mx(bitmap), to_mx(row_offsets), n_cols, None if rows is None else to_mx(rows)
    )
    return to_torch(out, values.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + ((64, 1000),))
def test_matches_reference_bitwise(dtype, shape):
    w, e = endor_case(shape, dtype, seed=shape[0] * 1000 + shape[1])
    args = (e.values, e.bitmap, e.row_offsets, shape[1])
    assert_bitwise_equal(decompress(*args), w)
    rows = torch.randint(0, shape[0], (2 * shape[0] + 1,), generator=torch.Generator().manual_seed(3))
    assert_bitwise_equal(decompress(*args, rows), endor_decompress_reference(*args, rows))


def test_edge_inputs():
    _, e = endor_case((7, 13), torch.bfloat16, seed=4)
    assert decompress(e.values, e.bitmap, e.row_offsets, 13, torch.empty(0, dtype=torch.int64)).shape == (0, 13)
    for density in (0.0, 1.0):
        w, e = endor_case((4, 40), torch.float16, seed=5, density=density)
        assert_bitwise_equal(decompress(e.values, e.bitmap, e.row_offsets, 40), w)


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda case: case[0][:40])
def test_refuses_bad_input(case):
    expected, args = case
    with pytest.raises(RuntimeError, match=expected):
        decompress(*args)


def test_names_the_first_bad_row():
    _, e = endor_case((7, 13), torch.float32, seed=11)
    offsets = e.row_offsets.clone()
    offsets[3] += 1
    with pytest.raises(RuntimeError, match=r"row 2: row_offsets says \d+ values but the bitmap has \d+ set bits"):
        decompress(e.values, e.bitmap, offsets, 13)
    with pytest.raises(RuntimeError, match=r"row 3: row_offsets says"):
        decompress(e.values, e.bitmap, offsets, 13, torch.tensor([6, 3, 2]))
    with pytest.raises(RuntimeError, match=r"rows\[1\]=7 is outside \[0, 7\)"):
        decompress(e.values, e.bitmap, e.row_offsets, 13, torch.tensor([0, 7, 9]))


def test_metal_kernel_source_is_found_and_accepted():
    # Running it needs Metal; building the kernel object checks the file is found and the call shape is valid.
    assert "simd_prefix_exclusive_sum" in fmlx.metal_source("endor_decompress.metal")
    assert fmlx.endor._endor_kernel() is not None
