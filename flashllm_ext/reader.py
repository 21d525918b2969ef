"""FlashReader: parallel direct reads of neuron bundles from a flash store into a tensor.

The native engine (csrc/io/flash_reader.cpp) opens the file with O_DIRECT, coalesces nearby neurons into one
read, widens reads to the file's direct-I/O alignment (statx, else 4 KiB; see `dio_offset_align`), runs them on a
pool of pread workers (or one io_uring ring when built with liburing) with the GIL released, and copies each
bundle from an aligned bounce buffer into its output row.

On a filesystem that refuses O_DIRECT the reader falls back to buffered reads and says so in `reader.direct`
(tmpfs accepts O_DIRECT on recent kernels, so on this machine /dev/shm keeps direct I/O).

Coalescing cost model: a separate read costs the device's latency to first byte, reading over a gap costs
gap / bandwidth. With `threads` reads in flight a separate read's latency overlaps the others', so its marginal
cost is latency / threads and gaps up to latency x bandwidth / threads bytes are read through (measured: on
Table 2 with 32 threads, the single-read gap of 116 KiB read 1.95x the needed bytes and was 1.3x slower than
merging adjacent neurons only). `flashllm_ext.disk.calibrate_disk` measures both and saves them; readers created
without an explicit `max_gap` use the saved profile, else DEFAULT_MAX_GAP.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ._native import require_native
from .disk import load_disk_profile
from .store import FlashStore

DEFAULT_THREADS = 32
DEFAULT_MIN_READ = 32 << 10  # the paper's minimum useful read size on flash
DEFAULT_MAX_READ = 1 << 20
DEFAULT_MAX_GAP = 64 << 10  # ~100 us x ~1 GB/s, the order of magnitude of a cloud SSD; calibrate to replace it


def _native_reader_class():
    require_native("FlashReader")
    return torch.classes.flashllm.FlashReader


def has_io_uring() -> bool:
    """Whether this build has the io_uring engine (liburing present at build time)."""
    require_native("FlashReader")
    return bool(torch.ops.flashllm.reader_has_io_uring())


@dataclass(frozen=True)
class ReadStats:
    """What one read call did. bytes_read counts alignment padding and coalesced gaps; bytes_requested counts
    each distinct requested bundle once."""
    bytes_requested: int
    bytes_read: int
    n_reads: int
    wall_s: float

    @property
    def mean_read_bytes(self) -> float:
        return self.bytes_read / self.n_reads if self.n_reads else 0.0

    @property
    def mbps(self) -> float:
        """Throughput of the bytes read from the device, in MB/s (10^6 bytes)."""
        return self.bytes_read / self.wall_s / 1e6 if self.wall_s > 0 else 0.0


class ReadResult(NamedTuple):
    """What one FlashReader.read call returns: `bundles, stats = reader.read(layer, ids)`. Each call has its own
    stats, so concurrent calls (read_async, several caches sharing a reader) never see each other's."""
    data: torch.Tensor  # [len(ids), bundle_width], the `out` tensor when one was given
    stats: ReadStats


class FlashReader:
    """Reads bundles of a FlashStore: `read(layer, ids, out)` fills out[i] with bundle ids[i].

    store: a FlashStore or its directory (a model's caches share `store.reader()` rather than opening their own).
    threads: worker threads (the io_uring engine: reads in flight).
    min_read: reads shorter than this absorb the next requested neuron whatever the gap. max_gap: largest gap in
    bytes read through to merge two reads (None: calibrated profile, else DEFAULT_MAX_GAP; -1 with min_read=0:
    no coalescing at all, one read per distinct neuron). max_read: cap on one coalesced read; the io_uring engine
    also issues a longer single row as several requests of at most max_read bytes. direct: O_DIRECT (falls back to
    buffered where refused, see `.direct`). engine: "threads" or "io_uring" (needs a liburing build, see
    has_io_uring()).

    dio_offset_align / dio_mem_align: the alignment in bytes that direct reads of this file keep for offsets and
    lengths / for buffers, as statx reports it (STATX_DIOALIGN), else 4096.
    """

    def __init__(self, store: FlashStore | str | os.PathLike | None, threads: int = DEFAULT_THREADS,
                 min_read: int = DEFAULT_MIN_READ, max_gap: int | None = None, max_read: int = DEFAULT_MAX_READ,
                 direct: bool = True, engine: str = "threads", *, file: str | os.PathLike | None = None):
        if (store is None) == (file is None):
            raise ValueError("give exactly one of store and file")
        self.store = None if store is None else store if isinstance(store, FlashStore) else FlashStore(store)
        path = os.fspath(file) if file is not None else self.store.bundles_path
        if max_gap is None:
            profile = load_disk_profile()
            max_gap = profile.max_gap_bytes(threads) if profile else DEFAULT_MAX_GAP
        self._native = _native_reader_class()(path, int(threads), int(min_read), int(max_gap), int(max_read),
                                              bool(direct), engine)
        self.path, self.threads, self.min_read, self.max_gap, self.max_read = path, threads, min_read, max_gap, max_read
        self.engine = engine
        self.direct: bool = bool(self._native.direct())
        self.dio_offset_align: int = int(self._native.dio_offset_align())
        self.dio_mem_align: int = int(self._native.dio_mem_align())
        self._executor: ThreadPoolExecutor | None = None

    @classmethod
    def for_file(cls, path: str | os.PathLike, **kwargs) -> FlashReader:
        """A reader over any file, addressed with read_rows (benchmarks, calibration)."""
        return cls(None, file=path, **kwargs)

    def read_rows(self, base: int, row_bytes: int, n_rows: int, ids: torch.Tensor, out: torch.Tensor) -> ReadStats:
        """out (CPU, contiguous, len(ids) * row_bytes bytes) row i = file[base + ids[i]*row_bytes :][:row_bytes].
        Returns the stats of this call."""
        if self._native is None:
            raise ValueError(f"{self!r} is closed")
        raw = self._native.read_rows(base, row_bytes, n_rows, ids, out)
        return ReadStats(raw[0], raw[1], raw[2], raw[3] / 1e9)

    def read(self, layer: int, ids: torch.Tensor | list[int], out: torch.Tensor | None = None) -> ReadResult:
        """Bundles `ids` [k] (any order, repeats allowed) of `layer` into out [k, bundle_width] (allocated when
        None; CPU, or CUDA through a pinned bounce buffer). Returns (out, the stats of this call)."""
        if self.store is None:
            raise ValueError("read() needs a store; this reader was opened on a plain file (use read_rows)")
        loc = self.store.layer_location(layer)
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        shape = (ids.numel(), self.store.bundle_width)
        if out is None:
            out = torch.empty(shape, dtype=self.store.dtype)
        if tuple(out.shape) != shape or out.dtype != self.store.dtype:
            raise ValueError(f"out must be {self.store.dtype} of shape {shape}, got {out.dtype} {tuple(out.shape)}")
        if out.device.type == "cuda":
            # Untested here (no GPU on the build machine). The caching host allocator keeps the pinned buffer
            # alive until the asynchronous copy on the current stream has finished.
            host = torch.empty(shape, dtype=out.dtype, pin_memory=True)
            stats = self.read_rows(loc.offset, loc.row_bytes, loc.n_neurons, ids, host)
            out.copy_(host, non_blocking=True)
            return ReadResult(out, stats)
        if out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous CPU or CUDA tensor, got {out.device} "
                             f"contiguous={out.is_contiguous()}")
        return ReadResult(out, self.read_rows(loc.offset, loc.row_bytes, loc.n_neurons, ids, out))

    def read_async(self, layer: int, ids: torch.Tensor | list[int], out: torch.Tensor | None = None) -> Future:
        """Like read, in the background (the GIL is released during I/O); the future's result is read's ReadResult.
        Calls complete in submission order."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashllm-reader")
        return self._executor.submit(self.read, layer, ids, out)

    def close(self) -> None:
        """Waits for the background reads, then frees the native reader: its worker threads end and its file is
        closed now rather than whenever the object is collected. Reads after close raise ValueError."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._native = None

    def __enter__(self) -> FlashReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"FlashReader({self.path!r}, engine={self.engine}, threads={self.threads}, direct={self.direct}, "
                f"min_read={self.min_read}, max_gap={self.max_gap})")
