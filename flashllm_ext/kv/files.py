"""KVFile: one preallocated file of fixed-size token rows, appended with O_DIRECT writes and read with O_DIRECT reads.

A row is one token's K (or V) for the (batch, head) pairs of a shard: `[pairs][head_dim]`, so the file is
`[token][pairs][head_dim]` and any token range is one contiguous byte range. The file is fallocated once to the
maximum sequence length (rounded up to the direct-I/O block), so appends never grow it (no metadata updates, no
fragmentation) and running out of space shows at creation, not mid-generation.

Writes: rows rarely fill whole blocks, so an append starts inside the block holding the end of the data already on
disk. The file keeps a copy of that partial block (`tail`), writes it again in front of the new rows and pads the
last block with zeros: every write is block aligned, from a page-aligned anonymous mmap buffer. The padding and the
rewritten tail are storage bytes and are counted as such.

Reads go through the native FlashReader (parallel pread on an O_DIRECT descriptor, reads widened to the block).
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from flashllm_ext.io.paths import create_file, regular_file
from flashllm_ext.flash.reader import FlashReader, ReadStats

BLOCK = 4096  # direct-I/O block: the reader widens to its file's statx alignment; 4 KiB covers every device here
READ_THREADS = 4
MAX_READ = 1 << 20

# fault_injector(path, offset, nbytes) runs before every write; it raises OSError to simulate ENOSPC/EIO.
FaultInjector = Callable[[str, int, int], None]


def align_down(x: int, a: int = BLOCK) -> int:
    return x // a * a


def align_up(x: int, a: int = BLOCK) -> int:
    return (x + a - 1) // a * a


@dataclass
class IOCounters:
    """Storage traffic of one file or shard: bytes as the device moves them (padding and rewritten tails
    included) and the number of requests."""

    bytes_read: int = 0
    n_reads: int = 0
    bytes_written: int = 0
    n_writes: int = 0

    def add(self, other: IOCounters) -> None:
        self.bytes_read += other.bytes_read
        self.n_reads += other.n_reads
        self.bytes_written += other.bytes_written
        self.n_writes += other.n_writes

    def minus(self, other: IOCounters) -> IOCounters:
        return IOCounters(
            self.bytes_read - other.bytes_read,
            self.n_reads - other.n_reads,
            self.bytes_written - other.bytes_written,
            self.n_writes - other.n_writes,
        )

    def copy(self) -> IOCounters:
        return IOCounters(self.bytes_read, self.n_reads, self.bytes_written, self.n_writes)


class KVFile:
    """Rows [0, length) of `row_bytes` bytes each, in a file preallocated for `max_tokens` rows.

    create=True makes a new file (replacing one there); False opens an existing one whose first `length` rows hold
    data. Neither follows a symbolic link at `path`.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        row_bytes: int,
        max_tokens: int,
        *,
        create: bool,
        length: int = 0,
        fault_injector: FaultInjector | None = None,
        read_threads: int = READ_THREADS,
    ):
        if row_bytes <= 0 or max_tokens <= 0:
            raise ValueError(f"row_bytes and max_tokens must be positive, got {row_bytes} and {max_tokens}")
        if not 0 <= length <= max_tokens:
            raise ValueError(f"length {length} outside [0, {max_tokens}]")
        self.path, self.row_bytes, self.max_tokens = os.fspath(path), row_bytes, max_tokens
        self.capacity = align_up(max_tokens * row_bytes)
        self.fault_injector = fault_injector
        self.counters = IOCounters()
        self._lock = threading.Lock()
        if create:  # a new file (the old one's blocks are not reused): created exclusively, private, never a link
            Path(self.path).unlink(missing_ok=True)
            os.close(create_file(self.path, private=True))
        else:
            regular_file(self.path)
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            self._fd = os.open(self.path, flags | os.O_DIRECT)
            self.direct = True
        except OSError as e:  # a filesystem without O_DIRECT: buffered, and `direct` says so
            if e.errno != errno.EINVAL:
                raise
            self._fd = os.open(self.path, flags)
            self.direct = False
        try:
            size = os.fstat(self._fd).st_size
            if create:
                os.posix_fallocate(self._fd, 0, self.capacity)
            elif size < self.capacity:
                raise ValueError(
                    f"{self.path}: {size} bytes, a KV file of {max_tokens} rows of {row_bytes} bytes "
                    f"needs {self.capacity}"
                )
            self._reader = FlashReader.for_file(
                self.path, threads=read_threads, min_read=0, max_gap=0, max_read=MAX_READ, direct=self.direct
            )
        except BaseException:
            os.close(self._fd)
            raise
        self._buffer = mmap.mmap(-1, BLOCK)
        self.length = length
        self._tail = bytearray()  # file bytes [align_down(length * row_bytes), length * row_bytes)
        if length:
            self._load_tail()

    def _load_tail(self) -> None:
        end = self.length * self.row_bytes
        start = align_down(end)
        if end > start:
            buf = memoryview(self._grow(BLOCK))[:BLOCK]
            got = os.preadv(self._fd, [buf], start)
            if got < end - start:
                raise OSError(errno.EIO, f"{self.path}: short read of the tail block at offset {start}")
            self._tail = bytearray(buf[: end - start])
        else:
            self._tail = bytearray()

    def _grow(self, nbytes: int) -> mmap.mmap:
        if len(self._buffer) < nbytes:
            # no close(): a tensor or memoryview of the old buffer may live on in a failed write's traceback;
            # the mapping goes when the last of them does
            self._buffer = mmap.mmap(-1, align_up(nbytes))
        return self._buffer

    def append(self, rows: torch.Tensor) -> int:
        """Writes rows (CPU, contiguous, n * row_bytes bytes) at row `length` in one write request, advances
        `length` and returns the bytes written (whole blocks: 0 when there were no rows). On failure (OSError naming
        the file, offset and errno) nothing changes: length and tail stay, the rows can be written again."""
        data = rows.contiguous().view(torch.uint8).reshape(-1)
        if data.numel() % self.row_bytes:
            raise ValueError(f"{data.numel()} bytes are not whole rows of {self.row_bytes}")
        n = data.numel() // self.row_bytes
        if self.length + n > self.max_tokens:
            raise ValueError(f"{self.path}: {self.length} + {n} rows exceed the preallocated {self.max_tokens}")
        if n == 0:
            return 0
        begin = self.length * self.row_bytes
        start = align_down(begin)
        end_data = begin + data.numel()
        end = align_up(end_data)
        buf = self._grow(end - start)
        view = torch.frombuffer(buf, dtype=torch.uint8, count=end - start)
        head = begin - start
        if head:
            view[:head] = torch.frombuffer(self._tail, dtype=torch.uint8)
        view[head : head + data.numel()] = data
        view[end_data - start :] = 0
        self._pwrite(memoryview(buf)[: end - start], start)
        with self._lock:
            self.counters.bytes_written += end - start
            self.counters.n_writes += 1
        tail_start = align_down(end_data)
        self._tail = bytearray(buf[tail_start - start : end_data - start])
        self.length += n
        return end - start

    def _pwrite(self, buf: memoryview, offset: int) -> None:
        try:
            if self.fault_injector is not None:
                self.fault_injector(self.path, offset, len(buf))
            done = 0
            while done < len(buf):
                n = os.pwrite(self._fd, buf[done:], offset + done)
                if n <= 0 or (self.direct and (done + n) % BLOCK and done + n < len(buf)):
                    raise OSError(errno.EIO, "short direct write")
                done += n
        except OSError as e:
            raise OSError(
                e.errno, f"KV write of {len(buf)} bytes to {self.path} at offset {offset} failed: {e.strerror or e}"
            ) from e

    def sync(self) -> None:
        """Makes every appended row durable (fdatasync: O_DIRECT bypasses the page cache, not the device's write
        cache, and the first write into a fallocated extent changes its metadata). Raises OSError naming the file."""
        try:
            os.fdatasync(self._fd)
        except OSError as e:
            raise OSError(e.errno, f"KV sync of {self.path} failed: {e.strerror or e}") from e

    def truncate(self, length: int = 0) -> None:
        """Forgets rows from `length` on (the file keeps its size)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate {self.path} of {self.length} rows to {length}")
        self.length = length
        self._load_tail()

    def read(self, t0: int, t1: int, out: torch.Tensor) -> ReadStats:
        """Rows [t0, t1) into out (CPU, contiguous, (t1 - t0) * row_bytes bytes), with direct reads. Thread safe."""
        if not 0 <= t0 <= t1 <= self.length:
            raise ValueError(f"{self.path}: rows [{t0}, {t1}) outside the {self.length} on disk")
        stats = self._reader.read_rows(0, self.row_bytes, self.max_tokens, torch.arange(t0, t1), out)
        with self._lock:
            self.counters.bytes_read += stats.bytes_read
            self.counters.n_reads += stats.n_reads
        return stats

    def close(self) -> None:
        if self._fd >= 0:
            self._reader.close()
            os.close(self._fd)
            self._fd = -1

    def __repr__(self) -> str:
        return (
            f"KVFile({self.path!r}, {self.length}/{self.max_tokens} rows of {self.row_bytes} B, direct={self.direct})"
        )
