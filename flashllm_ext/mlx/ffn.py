"""MLXFlashFFN: the torch engine's FlashFFN with its rows and its compute on mx.arrays.

Everything but the arithmetic is FlashFFN's, unchanged: the active sets (a predictor's answer, on the host), the
grouping of a prompt's tokens, the prefill path, the overlapped decode step, and the NeuronCache (planning,
swap-delete, reads) over an MLXTransfer, whose rows are an mx.array the reads land in. Each `_compute_rows` runs
flashllm_ext.mlx.sparse_ffn (Metal kernels on Apple Silicon, mlx ops elsewhere) on that mx.array over exactly the
token's cached rows and adds the result into a float32 accumulator that is itself an mx.array viewed from the host.
The result is evaluated there: the host must know a computation that reads the rows has run before the next cache
step writes them, and the next layer's planning waits for this token's predictor answer on the host anyway.

MLXStreamingFFN is the same for the torch engine's StreamingFFN (naive and hybrid modes): its reads, stats and
budget are StreamingFFN's, its resident bundles and the staging buffer the layers share are mx.arrays of the
MLXTransfer (the reads land in them), and every neuron is computed by sparse_ffn on those arrays. The result is
evaluated before the forward returns for the same reason: the next layer's reads overwrite the shared staging.
"""

from __future__ import annotations

import os

import mlx.core as mx
import torch

from flashllm_ext.flash.ffn import FFNStats, FlashFFN
from flashllm_ext.flash.streaming import StreamingFFN
from flashllm_ext.flash.reader import FlashReader
from flashllm_ext.flash.store import FlashStore
from flashllm_ext.mlx.sparse_ffn import quantized_sparse_ffn, sparse_ffn
from flashllm_ext.mlx.transfer import MX_DTYPE, MLXTransfer, to_mx, torch_view


def _flat_input(ffn: FlashFFN | StreamingFFN, x: mx.array) -> mx.array:
    """x [..., d] as [T, d], refused with a clear message unless it is a float mx.array ending in the hidden size."""
    d = ffn.store.hidden_size
    if not isinstance(x, mx.array):
        raise ValueError(f"{type(ffn).__name__} takes an mx.array, got {type(x).__name__}")
    if x.ndim < 1 or x.shape[-1] != d:
        raise ValueError(f"x must end in the hidden size {d}, got shape {tuple(x.shape)}")
    if x.dtype not in (mx.float32, mx.float16, mx.bfloat16):
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    return x.reshape(-1, d)


def bundle_ffn(
    store: FlashStore,
    x: mx.array,
    matrix: mx.array,
    num_used: int,
    bias: mx.array | None,
    activation: str,
    index: mx.array | None = None,
    threshold: float = 0.0,
) -> mx.array:
    """flashllm_ext.flash.ffn.bundle_ffn on mx.arrays: sparse_ffn over float bundles, quantized_sparse_ffn over a
    quantized store's."""
    if store.bundle_format is None:
        return sparse_ffn(x, matrix, num_used, bias, activation, store.glu, index=index, threshold=threshold)
    return quantized_sparse_ffn(
        x, matrix, num_used, bias, activation, store.glu, store.bundle_format.name, index=index, threshold=threshold
    )


def _check_transfer(cls: type, transfer) -> MLXTransfer:
    if transfer is None:
        return MLXTransfer()
    if not isinstance(transfer, MLXTransfer):
        raise ValueError(
            f"{cls.__name__} keeps its rows in mx.arrays: transfer must be an MLXTransfer, got "
            f"{type(transfer).__name__}"
        )
    return transfer


class MLXFlashFFN(FlashFFN):
    """One FFN layer served from a flash store, computed on mx.arrays: forward(x mx.array [..., d]) -> mx.array of x's
    shape and dtype. Arguments are FlashFFN's; `transfer` must be an MLXTransfer (default: a new one; a model's
    layers share one). predictor: as FlashFFN's, a torch callable on x [T, d] (x reaches it as a torch view)."""

    def __init__(
        self,
        store: FlashStore | str | os.PathLike,
        layer: int,
        *,
        transfer: MLXTransfer | None = None,
        device: str | torch.device | None = None,
        **kwargs,
    ):
        transfer = _check_transfer(MLXFlashFFN, transfer)
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"MLXFlashFFN runs where mlx runs; its host side is on the CPU, got device={device}")
        super().__init__(store, layer, transfer=transfer, **kwargs)
        self.dtype = MX_DTYPE[self.store.dtype]
        # The mx.arrays the cache's rows and bias are views of: sparse_ffn reads these.
        self.matrix = transfer.array(self.cache.matrix)
        self.bias = transfer.array(self.cache.bias)

    def forward(self, x: mx.array) -> mx.array:
        flat = _flat_input(self, x)
        acc = mx.zeros(flat.shape, dtype=mx.float32)
        out = torch_view(acc)  # the accumulator: sparse_ffn results are added into its memory from the host
        self._accumulate(torch_view(flat) if self.predictor is not None else None, flat.astype(self.dtype), out)
        if self.out_bias is not None:
            out += self.out_bias
        return acc.astype(x.dtype).reshape(x.shape)

    def _compute_rows(self, x: mx.array, rows: torch.Tensor | None, num_used: int, out: torch.Tensor) -> None:
        """out [T, d] float32 += the FFN of x [T, d] (mx.array, store dtype) over the cache's rows `rows` (None: rows
        [0, num_used))."""
        start = self.cache.transfer.clock()
        index = None if rows is None else to_mx(rows)
        y = bundle_ffn(
            self.store, x, self.matrix, num_used, self.bias, self.activation, index=index, threshold=self.threshold
        )
        out += torch_view(y.astype(mx.float32))  # evaluates y: the rows may be written again from here on
        self.stats.compute_s += self.cache.transfer.clock() - start


class MLXStreamingFFN(StreamingFFN):
    """One FFN layer computed densely from a flash store on mx.arrays (naive / hybrid modes): forward(x mx.array
    [..., d]) -> mx.array of x's shape and dtype. Arguments are StreamingFFN's; `staging` must come from
    `transfer`, an MLXTransfer (the engine allocates it there: flashllm_ext.flash.stack.ffn_stack)."""

    def __init__(
        self,
        store: FlashStore,
        layer: int,
        resident_rows: int,
        staging: torch.Tensor,
        reader: FlashReader,
        stats: FFNStats | None = None,
        transfer: MLXTransfer | None = None,
    ):
        transfer = _check_transfer(MLXStreamingFFN, transfer)
        super().__init__(store, layer, resident_rows, staging, reader, stats, transfer)
        self.dtype = MX_DTYPE[store.dtype]
        # The mx.arrays the resident bundles and the staging are (views of), with their input biases: what
        # sparse_ffn reads.
        self.arrays = [
            (transfer.array(rows), num_used, None if bias is None else to_mx(bias))
            for rows, num_used, bias in self.parts
        ]

    def forward(self, x: mx.array) -> mx.array:
        flat = _flat_input(self, x)
        acc = mx.zeros(flat.shape, dtype=mx.float32)
        self._accumulate(flat.astype(self.dtype), torch_view(acc))
        return acc.astype(x.dtype).reshape(x.shape)

    def _compute(self, xs: mx.array, out: torch.Tensor) -> torch.Tensor:
        """out [T, d] float32 += the FFN of xs [T, d] (mx.array, store dtype) over every neuron. Returns out."""
        for rows, num_used, bias in self.arrays:
            y = bundle_ffn(self.store, xs, rows, num_used, bias, self.activation)
            out += torch_view(y.astype(mx.float32))  # evaluates y: the next layer's reads overwrite the staging
        return out
