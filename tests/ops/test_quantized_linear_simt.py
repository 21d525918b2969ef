"""The CUDA quantized_linear body, run on the CPU through the SIMT emulation (flashllm_ext._simt), launcher as
shipped, against the pure-torch reference: odd shapes (d not a multiple of 32, rows past one block of 8 warps and
past one warp's 32 blocks), 1 and 11 tokens (two launches), every format and dtype, a NaN block, bad inputs. Small
shapes: every emulated GPU thread is an OS thread."""

import pytest
import torch

from flashllm_ext.ops import quantized_linear_reference
from flashllm_ext.ops.blocks import BLOCK_FORMATS
from tests.helpers.ffn_cases import assert_close, bad_quantized_linear_cases, quantized_linear_case
from tests.helpers.native import require_simt

require_simt()
CUDA = torch.ops.flashllm_simt.quantized_linear_cuda
# (d, rows): one column, odd sizes, a row of 33 blocks (a lane takes two), more rows than one block's 8 warps.
SHAPES = [(1, 1), (33, 7), (64, 19), (1056, 3), (200, 20)]


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
@pytest.mark.parametrize("shape", SHAPES)
def test_body_matches_reference(fmt, shape):
    d, n = shape
    for n_tok, with_bias in ((1, True), (11, False)):  # 11: a launch of 8 tokens, then one of 3
        x, w, b = quantized_linear_case(n_tok, d, n, fmt, seed=n_tok + d)
        bias = b if with_bias else None
        assert_close(CUDA(x, w, fmt, bias), quantized_linear_reference(x, w, fmt, bias))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_non_contiguous_and_degenerate_x(dtype):
    x, w, b = quantized_linear_case(4, 96, 10, "q4_1", dtype)
    xt = x.t().contiguous().t()
    assert_close(CUDA(xt, w, "q4_1", b), quantized_linear_reference(x, w, "q4_1", b))
    assert CUDA(x[:0], w, "q4_1", b).shape == (0, 10)
    assert CUDA(x, w[:0], "q4_1", b[:0]).shape == (4, 0)


def test_a_block_of_x_with_nan_or_inf_makes_its_outputs_nan():
    x, w, _ = quantized_linear_case(3, 64, 5, "q8_0")
    x[1, 40] = float("nan")
    x[2, 3] = float("inf")
    got, want = CUDA(x, w, "q8_0"), quantized_linear_reference(x, w, "q8_0", None)
    assert torch.equal(got.isnan(), want.isnan()) and got[1:].isnan().all()
    assert_close(got[0], want[0])


@pytest.mark.parametrize("case", bad_quantized_linear_cases(), ids=lambda c: c[0][:30])
def test_bad_inputs(case):
    match, args = case
    with pytest.raises(RuntimeError, match=match):
        CUDA(*args)
