"""MLX backend: flashllm ops on `mlx.core` arrays.

Importing this module imports mlx (`import flashllm_ext` alone never does). On Apple Silicon with Metal the ops run
the kernels in `metal/` through `mx.fast.metal_kernel`; elsewhere (Linux, mlx[cpu]) they run a fallback made of
mlx ops. Both move bits, so NaN payloads and -0.0 survive, and both check their inputs as the torch kernels do,
raising the same RuntimeError messages.

The ops live in endor.py (endor_decompress, endor_linear) and sparse_ffn.py (sparse_ffn; quantized_sparse_ffn, mlx
ops on every device: a quantized store's blocks), the Metal kernels' paths in metal.py. On these ops stands the MLX
engine: MLXTransfer (transfer.py: a NeuronCache's rows in mx.arrays), MLXFlashFFN and MLXStreamingFFN (ffn.py:
FlashFFN and StreamingFFN computing with sparse_ffn, or quantized_sparse_ffn, on them) and a Llama-family decoder
with `load_flash` (model.py; a quantized store's resident blocks as mlx's own quantization: quantized.py).
"""

from __future__ import annotations

from flashllm_ext.mlx.endor import endor_decompress, endor_linear
from flashllm_ext.mlx.ffn import MLXFlashFFN, MLXStreamingFFN
from flashllm_ext.mlx.metal import metal_available, metal_source
from flashllm_ext.mlx.model import load_flash
from flashllm_ext.mlx.sparse_ffn import quantized_sparse_ffn, sparse_ffn
from flashllm_ext.mlx.transfer import MLXTransfer

__all__ = [
    "MLXFlashFFN",
    "MLXStreamingFFN",
    "MLXTransfer",
    "endor_decompress",
    "endor_linear",
    "load_flash",
    "metal_available",
    "metal_source",
    "quantized_sparse_ffn",
    "sparse_ffn",
]
