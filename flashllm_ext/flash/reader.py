"""FlashReader: parallel direct reads of neuron bundles from a flash store into a tensor.

The native engine (csrc/io/flash_reader.cpp) opens the file with O_DIRECT, coalesces nearby neurons into one
read, widens reads to the file's direct-I/O alignment (statx, else 4 KiB; see `dio_offset_align`), runs them on a
pool of pread workers (or one io_uring ring when built with liburing) with the GIL released, and copies each
bundle from an aligned bounce buffer into its output row; a range of the file that lies back to back in memory
(read_range: a layer's streamed bundles) lands in place instead, with no copy.

Endor stores (store.endor): a neuron's bundle is one variable-length row [bitmap | values] (store.EndorLocation);
the reader reads the distinct requested rows (coalesced by the same rule), splitting each into a bitmap and a
values staging buffer, then `endor_decompress(rows=..., out=...)` writes the dense bundles straight into `out` in
the requested order (repeats included): ~56% of the bytes of a dense bundle move at 50% sparsity. The coalescing
rule counts rows, not the file's bytes: a row counts as its dense bundle (store.row_bytes), so max_gap, min_read and
max_read mean the same neurons for the Endor and the dense store of a model, both merge the same runs, and the Endor
store reads fewer bytes (counting its own, shorter rows would read through more unrequested neurons).

Destinations: a CPU `out` is filled by the native reader ("host" path). A CUDA `out` (select_read_path) goes
through kvikio's CuFile when kvikio imports ("kvikio": straight into GPU memory, GPUDirect Storage where the
machine has it, kvikio's POSIX compatibility mode otherwise; coalesced reads planned by the native reader) or,
without kvikio, through pinned host buffers and an asynchronous copy ("pinned"); Endor rows are decompressed on
the destination device, so only compressed bytes cross to the GPU. ReadStats.path says which was taken.

On a filesystem that refuses O_DIRECT the reader falls back to buffered reads and says so in `reader.direct`
(tmpfs accepts O_DIRECT on recent kernels, so on this machine /dev/shm keeps direct I/O).

Coalescing cost model: a separate read costs the device's latency to first byte, reading over a gap costs
gap / bandwidth. With `threads` reads in flight a separate read's latency overlaps the others', so its marginal
cost is latency / threads and gaps up to latency x bandwidth / threads bytes are read through (measured: on
Table 2 with 32 threads, the single-read gap of 116 KiB read 1.95x the needed bytes and was 1.3x slower than
merging adjacent neurons only). `flashllm_ext.flash.calibrate.calibrate_disk` measures both and saves them; readers created
without an explicit `max_gap` use the saved profile, else DEFAULT_MAX_GAP.
"""

from __future__ import annotations

import importlib
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from flashllm_ext import ops
from flashllm_ext.ops.native import require_native
from flashllm_ext.io.disk import load_disk_profile
from flashllm_ext.errors import FormatError
from flashllm_ext.io.paths import regular_file
from flashllm_ext.flash.store import EndorLocation, FlashStore, layer_tensor_name, neuron_ids
from flashllm_ext.io.buffers import pinned_bytes

DEFAULT_THREADS = 32
MAX_THREADS = 1024  # the native reader's limit (csrc/io/flash_reader.cpp), for checks before one is made
DEFAULT_MIN_READ = 32 << 10  # the paper's minimum useful read size on flash
DEFAULT_MAX_READ = 1 << 20
DEFAULT_MAX_GAP = 64 << 10  # ~100 us x ~1 GB/s, the order of magnitude of a cloud SSD; calibrate to replace it
DEFAULT_ENDOR_STAGING = 2 << 20  # compressed bytes staged per piece of an Endor read (bounds its extra memory)
READ_PATHS = ("host", "kvikio", "pinned")
# kvikio's bounce buffer in its POSIX compatibility mode (no GPUDirect Storage), set by FlashReader (kvikio's default
# is 16 MiB): its pool keeps one pinned buffer per I/O thread for the life of the process, host memory that
# host_bounce_bytes charges to the budget.
KVIKIO_BOUNCE_BYTES = 4 << 20


def _native_reader_class():
    require_native("FlashReader")
    return torch.classes.flashllm.FlashReader


def has_io_uring() -> bool:
    """Whether this build has the io_uring engine (liburing present at build time)."""
    require_native("FlashReader")
    return bool(torch.ops.flashllm.reader_has_io_uring())


def kvikio_available() -> bool:
    """Whether kvikio imports (the `[gpu]` extra). A broken install (its import raising OSError or RuntimeError for a
    missing libcufile or a CUDA mismatch) counts as absent: the pinned-buffer path serves instead."""
    try:
        importlib.import_module("kvikio")
    except Exception:
        return False
    return True


def select_read_path(device: torch.device | str) -> str:
    """How a read lands in a tensor on `device` (one of READ_PATHS): "host" for the CPU; for CUDA "kvikio" when
    kvikio imports, else "pinned" (pinned host buffers + an asynchronous copy). Other devices raise ValueError."""
    device = torch.device(device)
    if device.type == "cpu":
        return "host"
    if device.type == "cuda":
        return "kvikio" if kvikio_available() else "pinned"
    raise ValueError(f"FlashReader reads into CPU or CUDA tensors, got a tensor on {device}")


def configure_kvikio(kvikio_defaults, threads: int) -> None:
    """kvikio's settings for FlashReader: `threads` I/O threads; in compatibility mode, bounce buffers of
    KVIKIO_BOUNCE_BYTES and O_DIRECT reads (auto_direct_io_read) where offset, size and buffer allow, as the native
    reader's, so no read is served from the page cache. kvikio before 25.02 takes the thread count only."""
    if not hasattr(kvikio_defaults, "set"):
        kvikio_defaults.num_threads_reset(threads)
        return
    kvikio_defaults.set("num_threads", threads)
    kvikio_defaults.set("bounce_buffer_size", KVIKIO_BOUNCE_BYTES)
    try:
        kvikio_defaults.set("auto_direct_io_read", True)
    except KeyError:  # no such setting before kvikio 25.08: its compatibility mode reads through the page cache
        pass


def host_bounce_bytes(read_path: str, largest_read: int, threads: int) -> int:
    """Host memory that reads of up to `largest_read` bytes into GPU memory pass through, by read path (READ_PATHS):
    "pinned", one pinned buffer as large as the read, as torch's caching host allocator rounds it
    (transfer.pinned_bytes); "kvikio", in its compatibility mode, its pool of pinned bounce buffers, one per I/O
    thread (KVIKIO_BOUNCE_BYTES each; none with GPUDirect Storage); "host", none."""
    if read_path not in READ_PATHS:
        raise ValueError(f"read_path must be one of {READ_PATHS}, got {read_path!r}")
    if largest_read == 0 or read_path == "host":
        return 0
    if read_path == "pinned":
        return pinned_bytes(largest_read)
    import kvikio.defaults

    compat = getattr(kvikio.defaults, "is_compat_mode_preferred", lambda: True)()
    return threads * KVIKIO_BOUNCE_BYTES if compat else 0


@dataclass(frozen=True)
class ReadStats:
    """What one read call did. bytes_read counts alignment padding and coalesced gaps; bytes_requested counts
    each distinct requested bundle once (compressed bytes for an Endor store). wall_s is the whole call, Endor
    decompression (decompress_s) included; path is how the data reached `out` (READ_PATHS)."""

    bytes_requested: int
    bytes_read: int
    n_reads: int
    wall_s: float
    path: str = "host"
    decompress_s: float = 0.0

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

    store: a FlashStore or its directory (a model's caches share `shared_reader(store)` rather than opening their own).
    threads: worker threads (the io_uring engine: reads in flight).
    min_read: reads shorter than this absorb the next requested neuron whatever the gap. max_gap: largest gap in
    bytes read through to merge two reads (for an Endor store, bytes of the dense bundles: the rule counts neurons) (None: calibrated profile, else DEFAULT_MAX_GAP; -1 with min_read=0:
    no coalescing at all, one read per distinct neuron). max_read: cap on one coalesced read; the io_uring engine
    also issues a longer single row as several requests of at most max_read bytes. direct: O_DIRECT (falls back to
    buffered where refused, see `.direct`). engine: "threads" or "io_uring" (needs a liburing build, see
    has_io_uring()).

    staging_bytes: an Endor read is split into pieces of about this many compressed bytes, each staged (bitmap +
    values) and decompressed before the next: the most extra memory a read takes (one row more at worst).

    bounce_limit: the most bytes the native bounce buffers (a read lands in one before its rows are copied out) hold
    at once, idle ones kept for the next call included; workers wait for room beyond it, and a read longer than the
    limit runs alone. None: no limit, one buffer per thread. See bounce_bound().

    dio_offset_align / dio_mem_align: the alignment in bytes that direct reads of this file keep for offsets and
    lengths / for buffers, as statx reports it (STATX_DIOALIGN), else 4096.
    """

    def __init__(
        self,
        store: FlashStore | str | os.PathLike | None,
        threads: int = DEFAULT_THREADS,
        min_read: int = DEFAULT_MIN_READ,
        max_gap: int | None = None,
        max_read: int = DEFAULT_MAX_READ,
        direct: bool = True,
        engine: str = "threads",
        *,
        file: str | os.PathLike | None = None,
        staging_bytes: int = DEFAULT_ENDOR_STAGING,
        bounce_limit: int | None = None,
    ):
        if (store is None) == (file is None):
            raise ValueError("give exactly one of store and file")
        self.store = None if store is None else store if isinstance(store, FlashStore) else FlashStore(store)
        path = regular_file(file) if file is not None else self.store.bundles_path
        if max_gap is None:
            profile = load_disk_profile()
            max_gap = profile.max_gap_bytes(threads) if profile else DEFAULT_MAX_GAP
        if bounce_limit is not None and bounce_limit < 0:
            raise ValueError(f"bounce_limit must be >= 0 or None, got {bounce_limit}")
        self._native = _native_reader_class()(
            path,
            int(threads),
            int(min_read),
            int(max_gap),
            int(max_read),
            bool(direct),
            engine,
            -1 if bounce_limit is None else int(bounce_limit),
        )
        self.bounce_limit = bounce_limit
        self.file_bytes = os.path.getsize(path)
        self.path, self.threads, self.min_read, self.max_gap, self.max_read = path, threads, min_read, max_gap, max_read
        self.engine = engine
        self.direct: bool = bool(self._native.direct())
        self.dio_offset_align: int = int(self._native.dio_offset_align())
        self.dio_mem_align: int = int(self._native.dio_mem_align())
        self.staging_bytes = int(staging_bytes)
        if self.staging_bytes < 1:
            raise ValueError(f"staging_bytes must be positive, got {staging_bytes}")
        self._executor: ThreadPoolExecutor | None = None
        self._cufile_handle = None

    @classmethod
    def for_file(cls, path: str | os.PathLike, **kwargs) -> FlashReader:
        """A reader over any file, addressed with read_rows (benchmarks, calibration)."""
        return cls(None, file=path, **kwargs)

    def read_rows(self, base: int, row_bytes: int, n_rows: int, ids: torch.Tensor, out: torch.Tensor) -> ReadStats:
        """out (contiguous, len(ids) * row_bytes bytes, on the CPU or a CUDA device: select_read_path) row i =
        file[base + ids[i]*row_bytes :][:row_bytes]; ids on the CPU. Returns the stats of this call. A CUDA `out`
        is written asynchronously on the current stream by the "pinned" path: synchronize before reading it on
        another stream."""
        path = select_read_path(out.device)
        if path == "kvikio":
            return self._read_cufile(base, row_bytes, n_rows, ids, out)
        if path == "pinned":
            # The caching host allocator keeps the pinned buffer alive until the asynchronous copy on the current
            # stream has finished.
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            stats = self.read_rows(base, row_bytes, n_rows, ids, host)
            out.copy_(host, non_blocking=True)
            return replace(stats, path=path)
        raw = self._native_reader().read_rows(base, row_bytes, n_rows, ids, out)
        return ReadStats(raw[0], raw[1], raw[2], raw[3] / 1e9)

    @property
    def range_unit(self) -> int:
        """The block read_range widens a range to and splits it by: both direct-I/O alignments (powers of two)
        divide it."""
        return max(self.dio_offset_align, self.dio_mem_align)

    def range_end(self, offset: int, nbytes: int) -> int:
        """The file offset where read_range(offset, nbytes, ...) stops reading: the range's end widened to a whole
        block (at most file_bytes for a range read_range accepts)."""
        unit = self.range_unit
        return -(-(offset + nbytes) // unit) * unit

    def range_bytes(self, offset: int, nbytes: int) -> int:
        """Bytes a landing buffer of read_range(offset, nbytes, ...) needs: the range widened to whole blocks."""
        return self.range_end(offset, nbytes) - offset // self.range_unit * self.range_unit

    def range_view(self, offset: int, nbytes: int, landing: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the view of `landing` that read_range(offset, nbytes, landing) leaves file bytes [offset, offset + nbytes)
        in, the part of landing it fills); reads nothing. Raises ValueError as read_range does."""
        unit = self.range_unit
        start, span = offset // unit * unit, self.range_bytes(offset, nbytes)
        if offset < 0 or nbytes <= 0:
            raise ValueError(f"need offset >= 0 and nbytes > 0, got {offset} and {nbytes}")
        if landing.dtype != torch.uint8 or landing.device.type != "cpu" or not landing.is_contiguous():
            raise ValueError(f"landing must be a contiguous uint8 CPU tensor, got {landing.dtype} on {landing.device}")
        if landing.numel() < span or landing.data_ptr() % unit:
            raise ValueError(
                f"landing must start on a {unit}-byte boundary and hold {span} bytes, got {landing.numel()} at "
                f"address {landing.data_ptr():#x}"
            )
        if self.range_end(offset, nbytes) > self.file_bytes:
            raise ValueError(f"bytes [{start}, {start + span}) pass the end of {self.path} ({self.file_bytes} bytes)")
        return landing[offset - start : offset - start + nbytes], landing[:span]

    def read_range(self, offset: int, nbytes: int, landing: torch.Tensor) -> tuple[torch.Tensor, ReadStats]:
        """File bytes [offset, offset + nbytes) with no bounce buffer and no copy: the range widened to whole direct-I/O
        blocks lands in `landing` (uint8, contiguous, on the CPU, starting on a block boundary, at least
        range_bytes(offset, nbytes) long) as it lies on the file, in parallel reads of up to max_read; returns the
        view of landing that holds the range (range_view), and the stats (bytes read: the widened range). A run of
        rows that lie back to back (a layer's streamed bundles) read this way moves each byte once, where read_rows
        copies every row out of a bounce buffer, and no bounce limit caps the reads in flight. Raises ValueError where
        landing does not qualify or the widened range passes the end of the file."""
        view, target = self.range_view(offset, nbytes, landing)
        unit = self.range_unit
        pages = target.numel() // unit
        # Rows of one block each, all of them: the native reader merges them into reads of up to max_read, each
        # aligned in the file and in memory, so each lands in place (its zero-copy path).
        raw = self._native_reader().read_rows(offset // unit * unit, unit, pages, torch.arange(pages), target)
        return view, ReadStats(nbytes, raw[1], raw[2], raw[3] / 1e9)

    def plan_rows(self, base: int, row_bytes: int, n_rows: int, ids: torch.Tensor) -> torch.Tensor:
        """int64 [n_reads, 2]: the coalesced reads (file offset, length) read_rows would issue for these rows, in
        file order, before widening to the direct-I/O alignment; nothing is read (what a placement saves, counted)."""
        return self._native_reader().plan_reads(base, row_bytes, n_rows, None, ids)

    def plan_layer(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """int64 [n_reads, 2]: the coalesced reads read(layer, ids) would issue for distinct sorted rows `ids` [k]
        (an Endor store's: of its compressed rows); nothing is read."""
        if self.store.endor:
            loc = self.store.endor_location(layer)
            return self._native_reader().plan_reads(loc.offset, self.store.row_bytes, 0, loc.starts, ids)
        loc = self.store.layer_location(layer)
        return self.plan_rows(loc.offset, loc.row_bytes, loc.n_neurons, ids)

    def _native_reader(self):
        if self._native is None:
            raise ValueError(f"{self!r} is closed")
        return self._native

    def read(self, layer: int, ids: torch.Tensor | list[int], out: torch.Tensor | None = None) -> ReadResult:
        """Bundles `ids` [k] (any order, repeats allowed) of `layer` into out [k, row_width] of the store's row_dtype
        (its float bundles or its quantized rows; allocated on the CPU
        when None; a contiguous CPU or CUDA tensor, see select_read_path). Endor stores are decompressed into out.
        Returns (out, the stats of this call)."""
        if self.store is None:
            raise ValueError("read() needs a store; this reader was opened on a plain file (use read_rows)")
        ids = neuron_ids(ids).contiguous()
        shape, dtype = (ids.numel(), self.store.row_width), self.store.row_dtype
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        if tuple(out.shape) != shape or out.dtype != dtype:
            raise ValueError(f"out must be {dtype} of shape {shape}, got {out.dtype} {tuple(out.shape)}")
        path = select_read_path(out.device)
        if not out.is_contiguous():
            raise ValueError(f"out must be contiguous, got strides {out.stride()}")
        if self.store.endor:
            return ReadResult(out, self._read_endor(layer, ids, out, path))
        loc = self.store.layer_location(layer)
        return ReadResult(out, self.read_rows(loc.offset, loc.row_bytes, loc.n_neurons, ids, out))

    def staging_bound(self) -> int:
        """The most memory one read stages beyond its `out` on the CPU: 0 for a dense store; for an Endor store a
        piece of about staging_bytes of compressed rows (at most a whole layer) plus one row, split into bitmap
        and values."""
        if self.store is None or not self.store.endor:
            return 0
        largest = max(int(self.store.endor_location(layer).starts[-1]) for layer in range(self.store.n_layers))
        return min(self.staging_bytes, largest) + self._longest_row()

    def _longest_row(self) -> int:
        """Bytes of the longest row of the store in its file: an Endor row holds at most its bitmap and every value."""
        bitmap = (self.store.bundle_width + 7) // 8 if self.store.endor else 0
        return bitmap + self.store.row_bytes

    def bounce_bound(self) -> int:
        """The most memory the native reader's bounce buffers hold for reads of the store (kept between calls):
        max(bounce_limit, the longest read's buffer), or without a limit one such buffer per thread. A read spans
        at most max_read bytes of dense rows (at least one row, at most a layer: the coalescing rule counts rows),
        i.e. that many of the file's longest rows, widened to the direct-I/O alignment."""
        if self.store is None:
            raise ValueError("bounce_bound() needs a store: a plain file's rows are the caller's")
        rows_per_read = min(self.store.n_neurons, max(1, self.max_read // self.store.row_bytes))
        align = self.dio_offset_align
        longest_read = -(-rows_per_read * self._longest_row() // align) * align + align
        if self.bounce_limit is None:
            return self.threads * longest_read
        return max(self.bounce_limit, longest_read)

    def bounce_bytes(self) -> int:
        """Bytes the native reader's bounce buffers hold now (at most bounce_bound() for store reads)."""
        return int(self._native_reader().bounce_bytes())

    def buffer_bound(self) -> int:
        """Everything the reader holds beyond the `out` tensors it fills, on the CPU: bounce_bound() +
        staging_bound(). What a DRAM budget charges for the reader (flashllm_ext.flash.engine)."""
        return self.bounce_bound() + self.staging_bound()

    def _read_endor(self, layer: int, ids: torch.Tensor, out: torch.Tensor, path: str) -> ReadStats:
        """Endor rows `ids` decompressed into out, in pieces of about staging_bytes of compressed rows (each piece
        a contiguous part of out, so decompression writes its rows in place)."""
        start = time.perf_counter()
        loc = self.store.endor_location(layer)
        ids = self.store.check_ids(ids)
        lengths = loc.starts[ids + 1] - loc.starts[ids]
        first_byte = torch.cumsum(lengths, 0) - lengths
        _, sizes = torch.unique_consecutive(first_byte // self.staging_bytes, return_counts=True)
        totals = [0, 0, 0]
        decompress_s, begin = 0.0, 0
        for size in sizes.tolist():
            piece = slice(begin, begin + size)
            requested, read, n_reads, piece_decompress_s = self._read_endor_piece(
                layer, loc, ids[piece], out[piece], path
            )
            totals = [totals[0] + requested, totals[1] + read, totals[2] + n_reads]
            decompress_s += piece_decompress_s
            begin += size
        return ReadStats(*totals, time.perf_counter() - start, path, decompress_s)

    def _read_endor_piece(
        self, layer: int, loc: EndorLocation, ids: torch.Tensor, out: torch.Tensor, path: str
    ) -> tuple[int, int, int, float]:
        """One piece: the distinct rows, coalesced, into bitmap + values staging; then decompression into out on its
        device. Returns (bytes requested, bytes read, reads, decompression seconds)."""
        unique, inverse = torch.unique(ids, return_inverse=True)
        item = self.store.dtype.itemsize
        tail_offsets = torch.zeros(unique.numel() + 1, dtype=torch.int64)
        torch.cumsum(loc.counts[unique] * item, 0, out=tail_offsets[1:])
        pinned = path != "host"
        if path == "kvikio":
            bitmap, values, raw = self._read_endor_cufile(loc, unique, tail_offsets, out.device)
        else:
            bitmap = torch.empty((unique.numel(), loc.head_bytes), dtype=torch.uint8, pin_memory=pinned)
            values = torch.empty(int(tail_offsets[-1]), dtype=torch.uint8, pin_memory=pinned)
            raw = self._native_reader().read_var_rows(
                loc.offset, loc.starts, self.store.row_bytes, loc.head_bytes, unique, bitmap, values, tail_offsets
            )
        start = time.perf_counter()
        row_offsets, rows = tail_offsets // item, inverse
        if out.device != bitmap.device:
            bitmap, values = bitmap.to(out.device, non_blocking=True), values.to(out.device, non_blocking=True)
        if out.device != row_offsets.device:
            row_offsets, rows = row_offsets.to(out.device), rows.to(out.device)
        try:
            ops.endor_decompress(
                values.view(self.store.dtype), bitmap, row_offsets, n_cols=self.store.bundle_width, rows=rows, out=out
            )
        except RuntimeError as e:
            raise FormatError(
                f"{layer_tensor_name(layer)}.rows",
                f"neuron rows {unique.tolist()[:8]}{'...' if unique.numel() > 8 else ''} are inconsistent: {e}",
                self.store.bundles_path,
            ) from None
        return raw[0], raw[1], raw[2], time.perf_counter() - start

    def _cufile(self):
        """kvikio's CuFile over the store's file (opened on first use), with `threads` I/O threads."""
        if self._cufile_handle is None:
            import kvikio
            import kvikio.defaults

            configure_kvikio(kvikio.defaults, self.threads)
            self._cufile_handle = kvikio.CuFile(self.path, "r")
        return self._cufile_handle

    def _cufile_stage(
        self, plan: torch.Tensor, device: torch.device, staging: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The coalesced reads `plan` [n, 2] (offset, length) back to back into one uint8 buffer on `device`
        (`staging` when given, else a new one), through kvikio (its thread pool runs them in parallel). Returns the
        buffer."""
        handle = self._cufile()
        if staging is None:
            staging = torch.empty(int(plan[:, 1].sum()), dtype=torch.uint8, device=device)
        # kvikio writes device memory from its own threads, outside torch's stream order: kernels still queued on the
        # current stream may read the destination (the caller's `out`) or memory the allocator just handed out again
        # as `staging`, so they finish first. (tests/flash/test_endor_store.py runs this on the CPU with a stand-in
        # CuFile.)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        futures, at = [], 0
        for offset, length in plan.tolist():
            futures.append((handle.pread(staging[at : at + length], length, offset), length, offset))
            at += length
        for future, length, offset in futures:
            got = future.get()
            if got != length:
                raise OSError(f"{self.path}: kvikio read {got} of {length} bytes at offset {offset} (file truncated?)")
        return staging

    @staticmethod
    def _staged_positions(plan: torch.Tensor, begins: torch.Tensor) -> torch.Tensor:
        """Where the file bytes `begins` (each inside one read of `plan`) lie in the staging buffer of the plan."""
        offsets, lengths = plan[:, 0].contiguous(), plan[:, 1]
        at = torch.cumsum(lengths, 0) - lengths
        read = torch.searchsorted(offsets, begins, right=True) - 1
        return at[read] + begins - offsets[read]

    def _read_cufile(self, base: int, row_bytes: int, n_rows: int, ids: torch.Tensor, out: torch.Tensor) -> ReadStats:
        """Dense rows through kvikio: the native reader's coalesced plan read into a staging buffer on out's device,
        then one gather of the requested rows (every read covers whole rows, so the staging is a matrix of rows)."""
        start = time.perf_counter()
        plan = self.plan_rows(base, row_bytes, n_rows, ids)
        rows = self._staged_positions(plan, base + ids * row_bytes) // row_bytes
        flat = out.view(torch.uint8).view(-1)
        if int(plan[:, 1].sum()) == flat.numel() and torch.equal(rows, torch.arange(rows.numel())):
            # The plan reads exactly out's rows in order (a whole range, as offloading reads a layer): straight in.
            staging = self._cufile_stage(plan, out.device, flat)
        else:
            staging = self._cufile_stage(plan, out.device)
            torch.index_select(staging.view(-1, row_bytes), 0, rows.to(out.device), out=flat.view(-1, row_bytes))
        return ReadStats(
            torch.unique(ids).numel() * row_bytes, staging.numel(), plan.shape[0], time.perf_counter() - start, "kvikio"
        )

    def _read_endor_cufile(
        self, loc: EndorLocation, unique: torch.Tensor, tail_offsets: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Distinct Endor rows through kvikio into a staging buffer on `device`, split there into the bitmap rows
        and the values (gathers by index). Returns (bitmap, values bytes, [bytes requested, bytes read, reads])."""
        plan = self._native_reader().plan_reads(loc.offset, self.store.row_bytes, 0, loc.starts, unique)
        staging = self._cufile_stage(plan, device)
        at = self._staged_positions(plan, loc.offset + loc.starts[unique]).to(device)
        heads = at[:, None] + torch.arange(loc.head_bytes, device=device)
        bitmap = staging[heads]
        tail_lengths = (tail_offsets[1:] - tail_offsets[:-1]).to(device)
        row_of_byte = torch.repeat_interleave(torch.arange(unique.numel(), device=device), tail_lengths)
        within = torch.arange(row_of_byte.numel(), device=device) - tail_offsets[:-1].to(device)[row_of_byte]
        values = staging[at[row_of_byte] + loc.head_bytes + within]
        requested = int((loc.starts[unique + 1] - loc.starts[unique]).sum())
        return bitmap, values, [requested, staging.numel(), plan.shape[0]]

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
        if self._cufile_handle is not None:
            self._cufile_handle.close()
            self._cufile_handle = None
        self._native = None

    def __enter__(self) -> FlashReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"FlashReader({self.path!r}, engine={self.engine}, threads={self.threads}, direct={self.direct}, "
            f"min_read={self.min_read}, max_gap={self.max_gap})"
        )


def shared_reader(store: FlashStore) -> FlashReader:
    """The store's one FlashReader (default settings), opened on first use and closed with the store. Every cache over a
    store reads through it: each reader owns a pool of worker threads and a file descriptor, so a cache per layer must
    not each start its own; concurrent calls are safe and each read returns its own stats."""
    return store.shared("reader", lambda: FlashReader(store))
