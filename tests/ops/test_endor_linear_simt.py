"""The CUDA and Metal endor_linear bodies, run on the CPU through the SIMT emulation (flashllm_ext._simt), launchers
as shipped, against the pure-torch reference (exactly: linear_case's values make every float32 sum exact).
Small shapes: every emulated GPU thread is an OS thread."""

import pytest
import torch

from flashllm_ext.ops import endor_linear_reference
from tests.helpers.native import require_simt
from tests.helpers.kernel_cases import BAD_LINEAR_CASES, LINEAR_DTYPES, linear_case

require_simt()
OPS = torch.ops.flashllm_simt
BODIES = {"cuda": OPS.endor_linear_cuda, "metal": OPS.endor_linear_metal}
# (rows, cols): one element, odd sizes, rows past one warp iteration (1024 columns) and, for T=8, past one x tile of
# the CUDA kernel (1024 columns at 8 tokens, 8192 at one), more rows than one block (8 warps).
SHAPES = [(1, 1), (7, 13), (19, 64), (3, 300), (2, 2100), (10, 40), (2, 8300)]


def run(body, x, e, bias=None):
    return BODIES[body](x, e.values, e.bitmap, e.row_offsets, e.shape[1], bias)


@pytest.mark.parametrize("body", ["cuda", "metal"])
@pytest.mark.parametrize("dtype", LINEAR_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_body_matches_reference_exactly(body, dtype, shape):
    for n_tok in (1, 3, 8, 11):  # 11: two launches (CUDA) / dispatches (Metal) of token groups
        x, _, e, b = linear_case(n_tok, shape, dtype, seed=n_tok + shape[1])
        for bias in (b, None):
            want = endor_linear_reference(x, e.values, e.bitmap, e.row_offsets, shape[1], bias)
            got = run(body, x, e, bias)
            assert got.dtype == want.dtype and torch.equal(got, want), (body, n_tok, (got - want).abs().max())


@pytest.mark.parametrize("body", ["cuda", "metal"])
def test_body_float32_x_non_contiguous_and_degenerate(body):
    x, w, e, b = linear_case(4, (9, 70), torch.bfloat16, x_dtype=torch.float32)
    xt = x.t().contiguous().t()
    assert torch.equal(run(body, xt, e, b), endor_linear_reference(x, e.values, e.bitmap, e.row_offsets, 70, b))
    assert run(body, x[:0], e).shape == (0, 9)
    for density in (0.0, 1.0):
        x, w, e, b = linear_case(2, (5, 33), torch.float16, density=density)
        assert torch.equal(run(body, x, e, b), endor_linear_reference(x, e.values, e.bitmap, e.row_offsets, 33, b))


@pytest.mark.parametrize("body", ["cuda", "metal"])
@pytest.mark.parametrize("case", BAD_LINEAR_CASES, ids=lambda case: case[0][:50])
def test_body_bad_inputs(body, case):
    expected, args = case
    with pytest.raises(RuntimeError, match=expected):
        BODIES[body](*args)


def test_cuda_body_without_checks_writes_refused_rows_as_zeros():
    # What the CUDA glue does without kernel checks: a bad row is never read past its range and comes out as 0.
    x, w, e, b = linear_case(3, (6, 20), torch.float32)
    bitmap = e.bitmap.clone()
    bitmap[4, 0] ^= 1  # row 4's popcount no longer matches its offsets
    got = OPS.endor_linear_cuda(x, e.values, bitmap, e.row_offsets, 20, b, check_data=False)
    want = endor_linear_reference(x, e.values, e.bitmap, e.row_offsets, 20, b)
    want[:, 4] = 0
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match=r"endor_linear: row 4: row_offsets says \d+ values but the bitmap has"):
        OPS.endor_linear_cuda(x, e.values, bitmap, e.row_offsets, 20, b)


def test_cuda_body_never_reads_past_values_for_a_row_with_extra_bits():
    # The last row's bitmap marks more values than remain in `values`: none past the end is read (ASan, under make
    # sanitize, sees the exactly sized clone) and the row's outputs are zeros.
    x, w, e, b = linear_case(2, (5, 40), torch.float16)
    bitmap = e.bitmap.clone()
    bitmap[4] = 0xFF
    got = OPS.endor_linear_cuda(x, e.values.clone(), bitmap, e.row_offsets, 40, b, check_data=False)
    want = endor_linear_reference(x, e.values, e.bitmap, e.row_offsets, 40, b)
    want[:, 4] = 0
    assert torch.equal(got, want)
