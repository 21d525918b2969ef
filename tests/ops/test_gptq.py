"""GPTQ rounding (flashllm_ext.ops.gptq) and the block formats' GPTQ paths (ops.blocks.quantize_rows_gptq,
quantize_columns_gptq): with uncorrelated inputs it is round to nearest on the same grid; with correlated ones it
lowers the error of the layer's outputs; the blocks keep quantize_rows' scales."""

import pytest
import torch

from flashllm_ext.ops.blocks import (
    BLOCK_FORMATS,
    dequantize_rows,
    quantize_columns_gptq,
    quantize_rows,
    quantize_rows_gptq,
)
from flashllm_ext.ops.gptq import gptq_codes, gptq_factor


def _correlated_inputs(n: int, d: int, seed: int) -> torch.Tensor:
    """[n, d] inputs whose channels are mixed (a full H) with a few loud channels, as an FFN's are."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) @ torch.randn(d, d, generator=g) / d**0.5
    x[:, :3] *= 6
    return x


def _output_error(x: torch.Tensor, w: torch.Tensor, w_q: torch.Tensor) -> float:
    return float((x @ (w - w_q).T).pow(2).mean())


@pytest.mark.parametrize("group,lo,hi", [(32, -127, 127), (16, 0, 15), (24, 0, 3)])
def test_uncorrelated_inputs_carry_no_error(group, lo, hi):
    """Orthogonal input channels (a diagonal H): no column's error reaches another, so GPTQ is round to nearest
    on the grid it is given."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 96, generator=g)
    x = torch.diag(torch.rand(96, generator=g) + 0.5)  # one input channel per row
    scale = torch.rand(40, 96 // group, generator=g) * 0.1 + 0.02
    offset = -((lo + hi) / 2) * scale
    codes = gptq_codes(w, gptq_factor(x), scale, offset, group, lo, hi)
    per_column = scale.repeat_interleave(group, dim=1), offset.repeat_interleave(group, dim=1)
    nearest = torch.clamp(torch.round((w - per_column[1]) / per_column[0]), lo, hi)
    assert codes.dtype == torch.int16 and torch.equal(codes.float(), nearest)


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
@pytest.mark.parametrize("d", [96, 100])
def test_block_rows_lower_the_output_error_on_the_same_grid(fmt, d):
    """Rows of W [out, in] (up / gate): the blocks hold quantize_rows' scales and minimums, every code in its
    range, and the error of x W^T on the calibration inputs is well below round to nearest's."""
    w = torch.randn(48, d, generator=torch.Generator().manual_seed(2))
    x = _correlated_inputs(512, d, seed=3)
    nearest, gptq = quantize_rows(w, fmt), quantize_rows_gptq(w, fmt, gptq_factor(x))
    f = BLOCK_FORMATS[fmt]
    header = 4 if f.has_min else 2
    blocks = gptq.view(48, -1, f.block_bytes)
    assert gptq.shape == nearest.shape
    assert torch.equal(blocks[..., :header], nearest.view(48, -1, f.block_bytes)[..., :header])
    assert not torch.equal(gptq, nearest)
    if d % 32:  # the padding weights of the last block still read back as zeros
        pad = dequantize_rows(gptq, fmt, d + 32 - d % 32)[:, d:]
        assert bool((pad.abs() <= blocks[:, -1, :2].contiguous().view(torch.float16).float().abs() * 0.5 + 1e-6).all())
    error = _output_error(x, w, dequantize_rows(gptq, fmt, d))
    assert error < 0.75 * _output_error(x, w, dequantize_rows(nearest, fmt, d))


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
def test_block_columns_lower_the_output_error_on_the_same_grid(fmt):
    """Columns of W [out, in] (down: neuron i's row is column i), each a whole row of blocks along `out`."""
    w = torch.randn(100, 64, generator=torch.Generator().manual_seed(4))
    x = _correlated_inputs(512, 64, seed=5)
    nearest, gptq = quantize_rows(w.t(), fmt), quantize_columns_gptq(w, fmt, gptq_factor(x))
    f = BLOCK_FORMATS[fmt]
    header = 4 if f.has_min else 2
    assert torch.equal(
        gptq.view(64, -1, f.block_bytes)[..., :header], nearest.view(64, -1, f.block_bytes)[..., :header]
    )
    error = _output_error(x, w, dequantize_rows(gptq, fmt, 100).t())
    assert error < 0.75 * _output_error(x, w, dequantize_rows(nearest, fmt, 100).t())


def test_a_dead_input_channel_is_free():
    """A channel that is zero on every input cannot change the outputs: H stays invertible and no NaN appears."""
    x = _correlated_inputs(256, 64, seed=6)
    x[:, 10] = 0
    factor = gptq_factor(x)
    assert bool(torch.isfinite(factor).all())
    w = torch.randn(8, 64)
    assert bool(torch.isfinite(dequantize_rows(quantize_rows_gptq(w, "q8_0", factor), "q8_0", 64)).all())


def test_a_row_weighted_w_counts_as_w_copies_of_it():
    """row_weights: H with a row weighted 5 is H with that row repeated 5 times (the same factor)."""
    x = _correlated_inputs(64, 32, seed=8)
    weights = torch.ones(64)
    weights[0] = 5
    repeated = torch.cat([x, x[:1].expand(4, -1)])
    torch.testing.assert_close(gptq_factor(x, weights), gptq_factor(repeated), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(gptq_factor(x, weights), gptq_factor(x), rtol=1e-3, atol=1e-3)


def test_bad_arguments_are_refused():
    x = _correlated_inputs(64, 32, seed=7)
    with pytest.raises(ValueError, match="calibration inputs as a 2-D float tensor"):
        gptq_factor(x[0])
    with pytest.raises(ValueError, match="calibration inputs as a 2-D float tensor"):
        gptq_factor(x[:0])
    with pytest.raises(ValueError, match="row_weights must be"):
        gptq_factor(x, torch.ones(3))
    with pytest.raises(ValueError, match="row_weights must be"):
        gptq_factor(x, -torch.ones(64))
    w, scale = torch.randn(4, 32), torch.ones(4, 1)
    with pytest.raises(ValueError, match="factor must be"):
        gptq_codes(w, gptq_factor(x[:, :16]), scale, scale, 32, 0, 15)
    with pytest.raises(ValueError, match="scale and offset must be"):
        gptq_codes(w, gptq_factor(x), torch.ones(4, 2), torch.ones(4, 2), 32, 0, 15)
    with pytest.raises(ValueError, match="holds inf or NaN"):
        quantize_rows_gptq(torch.full((4, 32), float("nan")), "q8_0", gptq_factor(x))
