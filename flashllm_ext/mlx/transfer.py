"""Where an MLX neuron cache's rows live: mx.arrays that the host-side cache code writes through torch views.

MLX runs on unified memory (Apple Silicon: a Metal buffer in shared storage; Linux: mlx's CPU device), so the
pointer matrix need not be staged: MLXTransfer allocates every device tensor of a NeuronCache (its rows, its bias) as
an mx.array and hands the cache a torch tensor over the same bytes (Python's buffer protocol, which mlx documents
as a writable view). Everything the CPU cache does then happens unchanged on MLX memory: the FlashReader reads the
missing bundles straight into the mx.array's free rows, ops.cache_compact swap-deletes its rows in place, planning
stays on the host's int64 tensors, and flashllm_ext.mlx.sparse_ffn computes on the mx.array (MLXTransfer.array).

mlx arrays are lazy and treated as immutable by mlx itself, so one rule keeps this sound: every mlx computation that
reads the rows is evaluated before the cache next writes them (MLXFlashFFN evaluates each sparse_ffn result
before its step returns). The arrays are owned by the transfer, so mlx never donates their buffers to a result.
"""

from __future__ import annotations

import mlx.core as mx
import torch

from flashllm_ext.ops.bits import BITS_VIEW
from flashllm_ext.flash.transfer import HostTransfer

MX_DTYPE = {
    torch.float32: mx.float32,
    torch.float16: mx.float16,
    torch.bfloat16: mx.bfloat16,
    torch.int8: mx.int8,
    torch.uint8: mx.uint8,
    torch.int32: mx.int32,
    torch.int64: mx.int64,
    torch.bool: mx.bool_,
}
TORCH_DTYPE = {v: k for k, v in MX_DTYPE.items()}


def torch_view(a: mx.array) -> torch.Tensor:
    """A CPU torch tensor of a's shape and dtype over the memory of `a`, evaluated first: writes through it change
    `a`. An `a` whose elements are not laid out row-major (a transpose, a broadcast) is copied into one that is, and
    the tensor views that copy."""
    if a.dtype not in TORCH_DTYPE:
        raise ValueError(f"no torch dtype for mlx {a.dtype}")
    dtype = TORCH_DTYPE[a.dtype]
    if a.size == 0:
        return torch.empty(tuple(a.shape), dtype=dtype)
    mx.eval(a)
    buffer = memoryview(a)
    if not buffer.c_contiguous:
        a = mx.contiguous(a)
        mx.eval(a)
        buffer = memoryview(a)
    return torch.frombuffer(buffer, dtype=dtype).view(tuple(a.shape))


def to_mx(t: torch.Tensor) -> mx.array:
    """A copy of the CPU tensor `t` as an mx.array, bit for bit (bfloat16 through its integer view: numpy has none)."""
    t = t.detach().cpu().contiguous()
    if t.dtype not in MX_DTYPE:
        raise ValueError(f"no mlx dtype for torch {t.dtype}")
    if t.dtype == torch.bfloat16:
        return mx.array(t.view(BITS_VIEW[t.dtype]).numpy()).view(mx.bfloat16)
    return mx.array(t.numpy(), dtype=MX_DTYPE[t.dtype])


class MLXTransfer(HostTransfer):
    """A NeuronCache's device tensors as mx.arrays, viewed by the cache as CPU torch tensors (see the module doc).
    Reads land in the rows directly (staged = False): there is nothing to copy on unified memory."""

    def __init__(self) -> None:
        self._arrays: dict[int, mx.array] = {}  # data pointer of each view -> the mx.array it views

    @property
    def nbytes(self) -> int:
        """The transfer holds no buffer of its own (the arrays are the caches', counted by them)."""
        return 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A torch view of a new zero-filled mx.array of `shape` and `dtype` (kept by the transfer: `array`)."""
        if dtype not in MX_DTYPE:
            raise ValueError(f"no mlx dtype for torch {dtype}")
        a = mx.zeros(shape, dtype=MX_DTYPE[dtype])
        view = torch_view(a)
        self._arrays[view.data_ptr()] = a
        return view

    def array(self, view: torch.Tensor | None) -> mx.array | None:
        """The mx.array that `view`, a tensor from `empty`, is a view of (None for None)."""
        if view is None:
            return None
        a = self._arrays.get(view.data_ptr())
        if a is None or tuple(a.shape) != tuple(view.shape):
            raise ValueError("this tensor was not allocated by this MLXTransfer")
        return a
