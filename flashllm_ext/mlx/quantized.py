"""A quantized store's resident weights on mlx: GGUF blocks as mlx's own affine quantization, exactly.

mlx quantizes a weight in groups of `group_size` consecutive columns as w = scale * q + bias (q unsigned, `bits`
wide, packed eight 4-bit or four 8-bit codes to a uint32, code i of a word at bits [i * bits, (i + 1) * bits)). A
GGUF block of 32 weights is such a group (flashllm_ext/ops/blocks.py):
  q4_0  w = d * (q - 8)   scale d, bias -8 d
  q4_1  w = d * q + m     scale d, bias m
  q8_0  w = d * q, q signed: q + 128 unsigned, scale d, bias -128 d
d and m are float16 and the biases their power-of-two multiples, so scales and biases in float16 hold them exactly:
`mx.quantized_matmul` multiplies by the weights the file holds, in its own kernels (Metal on Apple Silicon). A
block then takes 36 / 20 / 20 bytes (q8_0 / q4_0 / q4_1: a bias beside each scale) against the file's 34 / 18 / 20.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import torch

from flashllm_ext.ops.blocks import BLOCK, QuantizedWeight, block_format

GROUP = BLOCK  # mlx's group: one GGUF block


@dataclass
class QuantizedArray:
    """A weight [rows, cols] in mlx's affine format: codes uint32 [rows, padded cols * bits / 32], scales and biases
    [rows, padded cols / 32] (padded cols: cols rounded up to a block, the padding zero weights)."""

    codes: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    cols: int

    @classmethod
    def from_blocks(cls, weight: QuantizedWeight, dtype: mx.Dtype = mx.float16) -> QuantizedArray:
        """The same weights as `weight`'s GGUF blocks, for activations of `dtype`: scales and biases in float16, which
        holds them exactly (bfloat16 would not), or float32 for float32 activations."""
        f = block_format(weight.fmt)
        rows = weight.blocks.shape[0]
        blocks = weight.blocks.reshape(rows, -1, f.block_bytes)
        d = blocks[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
        if f.bits == 8:
            q = blocks[..., 2:].contiguous().view(torch.int8).to(torch.int64) + 128
            bias = -128 * d
        else:
            packed = blocks[..., 4 if f.has_min else 2 :].to(torch.int64)
            q = torch.cat([packed & 0x0F, packed >> 4], dim=-1)
            bias = blocks[..., 2:4].contiguous().view(torch.float16).float()[..., 0] if f.has_min else -8 * d
        per_word = 32 // f.bits
        shifts = torch.arange(per_word, dtype=torch.int64) * f.bits
        words = (q.reshape(rows, -1, per_word) << shifts).sum(-1)  # < 2^32: the codes' bits do not overlap
        codes = mx.array(words.numpy().astype(np.uint32))
        exact = mx.float32 if dtype == mx.float32 else mx.float16
        return cls(codes, mx.array(d.numpy()).astype(exact), mx.array(bias.numpy()).astype(exact), f.bits, weight.cols)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.biases.nbytes

    def _padded(self, x: mx.array) -> mx.array:
        pad = self.scales.shape[1] * GROUP - self.cols
        return x if pad == 0 else mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])

    def matmul_t(self, x: mx.array) -> mx.array:
        """x [..., cols] @ W^T -> [..., rows] of x's dtype (an nn.Linear's product; bfloat16 x meets float16 scales
        in float32)."""
        y = mx.quantized_matmul(
            self._padded(x), self.codes, self.scales, self.biases, transpose=True, group_size=GROUP, bits=self.bits
        )
        return y.astype(x.dtype)

    def rows(self, ids: mx.array, dtype: mx.Dtype) -> mx.array:
        """Rows `ids` dequantized (an embedding's lookup) -> [len(ids), cols] of `dtype`, computed in float32."""
        scales, biases = self.scales[ids].astype(mx.float32), self.biases[ids].astype(mx.float32)
        w = mx.dequantize(self.codes[ids], scales, biases, group_size=GROUP, bits=self.bits)
        return w[..., : self.cols].astype(dtype)
