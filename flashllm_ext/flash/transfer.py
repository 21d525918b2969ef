"""Where a neuron cache's rows live and how read bundles reach them: the device-specific part of NeuronCache.

The cache logic (planning, compaction, bookkeeping; flashllm_ext/flash/cache.py) is the same on every device. What differs
is behind this small interface:

  HostTransfer     the rows are in host memory: reads land in them directly, nothing is copied (the CPU cache)
  StagedTransfer   the rows are on a compute device (a GPU): reads land in a host staging buffer (pinned on CUDA),
                   a copy stream moves them to their rows, and events order the copy after the compaction that
                   freed the rows and before the compute that uses them, so the host never waits on the device for
                   them. Given device="cpu" it runs the same code path with CPU tensors and no streams: the test
                   double that checks the staged state machine step by step on a machine without a GPU.

A model's caches share one transfer (its staging buffer is sized by the largest step of any of them; steps run one at
a time), as they share one FlashReader.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from flashllm_ext import ops
from flashllm_ext.io.buffers import pinned_buffer
from flashllm_ext.runtime import cuda_device


# ops.cache_compact's signature: (matrix, pointer, rows, *, num_used, bias, slot_of) -> new num_used.
CompactFn = Callable[..., int]


class HostTransfer:
    """The CPU cache: its rows are host memory, a read writes straight into them."""

    staged = False
    device = torch.device("cpu")
    nbytes = 0

    def clock(self) -> float:
        """The clock of the engine's per-token breakdown."""
        return time.perf_counter()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host


class StagedTransfer:
    """Rows on `device`; reads through a host staging buffer and a copy stream (see the module doc).

    device: "cuda" (pinned staging, a dedicated copy stream, events) or "cpu" (plain staging, no streams: the same
    state machine, for tests). compact: the swap-delete to run on the device rows (default ops.cache_compact; tests
    pass the SIMT emulation of the shipped CUDA launcher). sync_timing: the breakdown's clock waits for the device
    (see `clock`); False leaves the host free to run ahead, and the parts then count launch time only.
    """

    staged = True

    def __init__(
        self, device: str | torch.device = "cuda", *, compact: CompactFn | None = None, sync_timing: bool = True
    ):
        self.device = cuda_device(device)
        self.sync_timing = sync_timing
        self._cuda = self.device.type == "cuda"
        self._compact = compact or ops.cache_compact
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._copied: torch.cuda.Event | None = None  # the last copy out of the staging buffer
        self._compacted: torch.cuda.Event | None = None  # the last compaction: the rows it freed may be written
        self.uploads = 0  # copies issued (tests check the deferred path ran)

    @property
    def nbytes(self) -> int:
        """Host bytes of the staging buffer (shared by every cache on this transfer; pinned page by page on CUDA, so
        what it pins)."""
        return self._staging.numel()

    def reserve(self, nbytes: int) -> None:
        """Grow the staging buffer to at least `nbytes` (at construction: steps then allocate no staging)."""
        if nbytes > self._staging.numel():
            self._wait_copied()  # the old buffer is unpinned once freed: no copy from it may be in flight
            self._staging = pinned_buffer(nbytes) if self._cuda else torch.empty(nbytes, dtype=torch.uint8)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def staging(self, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """Host rows [k, width] for a read to land in. Waits (on the host) only for the previous copy out of the
        buffer, issued one cache step earlier, to have left it."""
        nbytes = shape[0] * shape[1] * dtype.itemsize
        if nbytes > self._staging.numel():
            raise ValueError(f"a step needs {nbytes} staging bytes but {self._staging.numel()} were reserved")
        self._wait_copied()
        return self._staging[:nbytes].view(dtype).view(shape)

    def upload(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """dst (device rows) <- src (staging rows): on the copy stream once the compaction that freed dst has run
        (not after the compute queued since, which it overlaps), and the compute stream's later work waits for it.
        No host wait."""
        self.uploads += 1
        if not self._cuda:
            dst.copy_(src)
            return
        compute = torch.cuda.current_stream(self.device)
        if self._compacted is not None:
            self._copy_stream.wait_event(self._compacted)
        else:
            self._copy_stream.wait_stream(compute)
        with torch.cuda.stream(self._copy_stream):
            dst.copy_(src, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(self._copy_stream)
        compute.wait_event(self._copied)
        # dst was allocated on the compute stream and is written on the copy stream: keep the caching allocator
        # from reusing its memory before the copy is done (it lives as long as the cache anyway).
        dst.record_stream(self._copy_stream)

    def clock(self) -> float:
        """time.perf_counter(), on CUDA (with sync_timing) once the work queued on the compute stream has run: the
        engine's per-token breakdown then gives device time to its parts (I/O, memory management, compute), not
        launch time. The cache's decisions never wait on the device; only these timing points do."""
        if self._cuda and self.sync_timing:
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A small host tensor (row indices, ids, bias values) on the device, copied asynchronously on the compute
        stream from pinned memory (the caching host allocator keeps it until the copy has run)."""
        if not self._cuda:
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def compact(
        self,
        matrix: torch.Tensor,
        pointer: torch.Tensor,
        rows: torch.Tensor,
        *,
        num_used: int,
        bias: torch.Tensor | None = None,
        slot_of: torch.Tensor | None = None,
    ) -> int:
        """The swap-delete of the host `rows` on the device's rows (queued on the compute stream)."""
        kept = self._compact(matrix, pointer, self.to_device(rows), num_used=num_used, bias=bias, slot_of=slot_of)
        if self._cuda:
            self._compacted = torch.cuda.Event()
            self._compacted.record(torch.cuda.current_stream(self.device))
        return kept

    def _wait_copied(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None


Transfer = HostTransfer | StagedTransfer


def make_transfer(device: str | torch.device) -> Transfer:
    """The transfer for caches on `device`: HostTransfer on the CPU, StagedTransfer on CUDA."""
    device = cuda_device(device)
    return HostTransfer() if device.type == "cpu" else StagedTransfer(device)
