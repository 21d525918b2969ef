"""flashllm_ext.mlx.endor_linear: its mlx-op fallback everywhere and, on Apple Silicon, its Metal kernel, against
the torch reference, exactly (linear_case's values make every float32 sum exact). Off Apple Silicon the Metal body
is tested through the SIMT emulation in test_endor_linear_simt.py."""

import pytest
import torch

from flashllm_ext.ops import endor_linear_reference
from tests.helpers.kernel_cases import BAD_LINEAR_CASES, LINEAR_DTYPES, linear_case
from tests.helpers.mlx_arrays import path, to_mx, to_torch  # noqa: F401  (path: the fallback and, where it exists, Metal)

mx = pytest.importorskip("mlx.core", reason="mlx is not importable (install the [mlx] extra)")
fmlx = pytest.importorskip("flashllm_ext.mlx")


def run(x, values, bitmap, row_offsets, n_cols, bias=None):
    out = fmlx.endor_linear(
        to_mx(x), to_mx(values), to_mx(bitmap), to_mx(row_offsets), n_cols, None if bias is None else to_mx(bias)
    )
    return to_torch(out, x.dtype)


@pytest.mark.parametrize("dtype", LINEAR_DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (19, 64), (3, 300)])
@pytest.mark.parametrize("n_tok", [1, 4, 11])
def test_matches_reference_exactly(dtype, shape, n_tok):
    x, _, e, b = linear_case(n_tok, shape, dtype, seed=n_tok + shape[1])
    for bias in (b, None):
        args = (x, e.values, e.bitmap, e.row_offsets, shape[1], bias)
        assert torch.equal(run(*args), endor_linear_reference(*args))


def test_float32_x_and_degenerate_sizes():
    x, _, e, b = linear_case(3, (9, 70), torch.float16, x_dtype=torch.float32)
    args = (x, e.values, e.bitmap, e.row_offsets, 70, b)
    assert torch.equal(run(*args), endor_linear_reference(*args))
    assert run(x[:0], e.values, e.bitmap, e.row_offsets, 70).shape == (0, 9)


@pytest.mark.parametrize("case", BAD_LINEAR_CASES, ids=lambda case: case[0][:50])
def test_refuses_bad_input(case):
    expected, args = case
    with pytest.raises(RuntimeError, match=expected):
        run(*args)


def test_metal_kernel_source_is_found_and_accepted():
    assert "simd_prefix_exclusive_sum" in fmlx.metal_source("endor_linear.metal")
    assert fmlx.endor._linear_kernel() is not None
