"""flashllm_ext.mlx.quantized: GGUF blocks as mlx's affine quantization hold exactly the file's weights (every block
format, a row length that is not a multiple of the block), multiply as the dequantized weights do, and take the
bytes the module doc states."""

import numpy as np
import pytest
import torch

from flashllm_ext.ops.blocks import BLOCK_FORMATS, QuantizedWeight, dequantize_rows, quantize_rows

mx = pytest.importorskip("mlx.core", reason="mlx is not importable (install the [mlx] extra)")
from flashllm_ext.mlx.quantized import QuantizedArray  # noqa: E402  (after the skip: imports mlx)

BYTES_PER_BLOCK = {"q8_0": 36, "q4_0": 20, "q4_1": 20}


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
@pytest.mark.parametrize("cols", [64, 80])
def test_blocks_become_the_same_weights(fmt, cols):
    g = torch.Generator().manual_seed(cols)
    blocks = quantize_rows(torch.randn(6, cols, generator=g) * 0.3, fmt)
    want = dequantize_rows(blocks, fmt, cols)
    weight = QuantizedArray.from_blocks(QuantizedWeight(blocks, fmt, cols))
    assert np.array_equal(np.array(weight.rows(mx.array([5, 0, 2]), mx.float32)), want[[5, 0, 2]].numpy())
    x = torch.randn(3, cols, generator=g)
    got = np.array(
        QuantizedArray.from_blocks(QuantizedWeight(blocks, fmt, cols), mx.float32).matmul_t(mx.array(x.numpy()))
    )
    np.testing.assert_allclose(got, (x @ want.t()).numpy(), rtol=1e-5, atol=1e-5)
    assert weight.nbytes == 6 * -(-cols // 32) * BYTES_PER_BLOCK[fmt]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_activations_keep_their_dtype_and_the_exact_scales(dtype):
    g = torch.Generator().manual_seed(1)
    blocks = quantize_rows(torch.randn(8, 64, generator=g) * 0.3, "q4_1")
    weight = QuantizedArray.from_blocks(QuantizedWeight(blocks, "q4_1", 64), dtype)
    assert weight.scales.dtype == mx.float16  # bfloat16 would round the file's float16 scales
    x = torch.randn(2, 64, generator=g)
    got = weight.matmul_t(mx.array(x.numpy()).astype(dtype))
    assert got.dtype == dtype
    want = (x @ dequantize_rows(blocks, "q4_1", 64).t()).numpy()
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, rtol=0.05, atol=0.05 * np.abs(want).max())
