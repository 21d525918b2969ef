"""MLXFlashFFN: the torch engine's FlashFFN with its rows and its compute on mx.arrays.

Everything but the arithmetic is FlashFFN's, unchanged: the active sets (a predictor's answer, on the host), the
grouping of a prompt's tokens, the prefill path, the overlapped decode step, and the NeuronCache (planning,
swap-delete, reads) over an MLXTransfer, whose rows are an mx.array the reads land in. Each `_compute` runs
flashllm_ext.mlx.sparse_ffn (Metal kernels on Apple Silicon, mlx ops elsewhere) on that mx.array over exactly the
token's cached rows and adds the result into a float32 accumulator that is itself an mx.array viewed from the host.
The result is evaluated there: the host must know a computation that reads the rows has run before the next cache
step writes them, and the next layer's planning waits for this token's predictor answer on the host anyway.
"""
from __future__ import annotations

import os

import mlx.core as mx
import torch

from ..ffn import FlashFFN
from ..store import FlashStore
from . import sparse_ffn
from .transfer import MX_DTYPE, MLXTransfer, to_mx, torch_view


class MLXFlashFFN(FlashFFN):
    """One FFN layer served from a flash store, computed on mx.arrays: forward(x mx.array [..., d]) -> mx.array of x's
    shape and dtype. Arguments are FlashFFN's; `transfer` must be an MLXTransfer (default: a new one; a model's
    layers share one). predictor: as FlashFFN's, a torch callable on x [T, d] (x reaches it as a torch view)."""

    def __init__(self, store: FlashStore | str | os.PathLike, layer: int, *, transfer: MLXTransfer | None = None,
                 device: str | torch.device | None = None, **kwargs):
        if transfer is None:
            transfer = MLXTransfer()
        if not isinstance(transfer, MLXTransfer):
            raise ValueError(f"MLXFlashFFN keeps its rows in mx.arrays: transfer must be an MLXTransfer, got "
                             f"{type(transfer).__name__}")
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"MLXFlashFFN runs where mlx runs; its host side is on the CPU, got device={device}")
        super().__init__(store, layer, transfer=transfer, **kwargs)
        self.dtype = MX_DTYPE[self.store.dtype]
        # The mx.arrays the cache's rows and bias are views of: sparse_ffn reads these.
        self.matrix = transfer.array(self.cache.matrix)
        self.bias = transfer.array(self.cache.bias)

    def forward(self, x: mx.array) -> mx.array:
        d = self.store.hidden_size
        if not isinstance(x, mx.array):
            raise ValueError(f"MLXFlashFFN takes an mx.array, got {type(x).__name__}")
        if x.ndim < 1 or x.shape[-1] != d:
            raise ValueError(f"x must end in the hidden size {d}, got shape {tuple(x.shape)}")
        if x.dtype not in (mx.float32, mx.float16, mx.bfloat16):
            raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
        flat = x.reshape(-1, d)
        acc = mx.zeros(flat.shape, dtype=mx.float32)
        out = torch_view(acc)  # the accumulator: sparse_ffn results are added into its memory from the host
        self._accumulate(torch_view(flat) if self.predictor is not None else None, flat.astype(self.dtype), out)
        if self.out_bias is not None:
            out += self.out_bias
        return acc.astype(x.dtype).reshape(x.shape)

    def _compute(self, x: mx.array, ids: torch.Tensor, out: torch.Tensor) -> None:
        """out [T, d] float32 += the FFN of x [T, d] (mx.array, store dtype) over neurons `ids`, all cached now."""
        start = self.cache.transfer.clock()
        cache = self.cache
        rows = to_mx(cache.slot_of[ids])
        y = sparse_ffn(x, self.matrix, cache.num_used, self.bias, self.activation, self.store.glu, index=rows,
                       threshold=self.threshold)
        out += torch_view(y.astype(mx.float32))  # evaluates y: the rows may be written again from here on
        self.stats.compute_s += self.cache.transfer.clock() - start
