"""Interconnect and storage bandwidth emulation for scaling studies (INF² Figures 3c and 16): a token bucket.

`Link(gbps)` paces the bytes that cross it: a transfer of n bytes waits until the bucket holds n tokens, refilled
at `gbps` x 10^9 / 8 bytes per second up to `burst_bytes`. Thread safe, so N workers (or N shards' transfers)
behind one shared `Link` share its bandwidth, as devices behind one PCIe switch do.

A storage device also has a cost per write request, which bandwidth alone does not model: a small durable write
(a KV spill is written and synced) occupies an SSD about as long as streaming `request_bytes` would. A write
transfer is charged max(nbytes, request_bytes), so fewer, larger writes (delayed writeback) cost less, as on a real
device. Reads keep their byte charge: the devices' reads are large (1 MiB blocks) and pipelined, so their per-request
cost is hidden behind the transfer. `probe_write_request` measures request_bytes on a real disk.
"""

from __future__ import annotations

import mmap
import os
import statistics
import threading
import time
from dataclasses import dataclass

from flashllm_ext.io.paths import scratch_file


class Link:
    """A token-bucket bandwidth limit of `gbps` gigabits per second. request_bytes: the least a write request is
    charged (0: writes cost their bytes). `transferred` counts the bytes that crossed, `charged` what the bucket
    was charged for them, `write_requests` the writes."""

    def __init__(self, gbps: float, burst_bytes: int = 256 << 10, request_bytes: int = 0):
        if gbps <= 0:
            raise ValueError(f"gbps must be positive, got {gbps}")
        if request_bytes < 0:
            raise ValueError(f"request_bytes must be >= 0, got {request_bytes}")
        self.gbps, self.burst_bytes, self.request_bytes = gbps, burst_bytes, int(request_bytes)
        self.bytes_per_s = gbps * 1e9 / 8
        self.transferred = self.charged = self.write_requests = 0
        self._tokens = float(burst_bytes)
        self._last = time.perf_counter()
        self._lock = threading.Lock()

    def transfer(self, nbytes: int, *, write: bool = False) -> None:
        """Blocks until `nbytes` may cross (the bucket may go negative: a transfer larger than the burst waits for
        its whole size, and later ones queue behind it). write: one write request, charged at least
        request_bytes."""
        cost = max(nbytes, self.request_bytes) if write else nbytes
        with self._lock:
            now = time.perf_counter()
            self._tokens = min(self.burst_bytes, self._tokens + (now - self._last) * self.bytes_per_s)
            self._last = now
            self._tokens -= cost
            self.transferred += nbytes
            self.charged += cost
            self.write_requests += write
            wait = -self._tokens / self.bytes_per_s if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)

    def __repr__(self) -> str:
        extra = f", {self.request_bytes} B per write request" if self.request_bytes else ""
        return f"Link({self.gbps:g} Gb/s{extra})"


@dataclass(frozen=True)
class WriteRequestProbe:
    """A disk's per-request write cost: `request_s` per small durable write, `seq_bytes_per_s` streaming, and their
    product `request_bytes` (the bytes the device could have streamed in the time of one small write)."""

    request_s: float
    seq_bytes_per_s: float
    write_bytes: int

    @property
    def request_bytes(self) -> int:
        return round(self.request_s * self.seq_bytes_per_s)


def probe_write_request(
    directory: str | os.PathLike,
    *,
    write_bytes: int = 4096,
    writes: int = 256,
    seq_bytes: int = 64 << 20,
    seq_block: int = 1 << 20,
    rounds: int = 3,
) -> WriteRequestProbe:
    """Measures, in a scratch file under `directory` (on the disk to model; removed after), the time of one
    `write_bytes` O_DIRECT | O_DSYNC write appended into a fallocated file (each write durable before the next,
    as a KV spill is written and fdatasync'ed into its preallocated file) and the sequential bandwidth of
    `seq_block` O_DIRECT writes of `seq_bytes` followed by one fdatasync. Medians of `rounds`."""
    buf = mmap.mmap(-1, max(write_bytes, seq_block))  # page aligned, as O_DIRECT wants
    buf.write(os.urandom(len(buf)))
    small, seq = [], []
    with scratch_file(directory, "write-probe") as path:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            for _ in range(rounds):
                os.ftruncate(fd, 0)
                os.posix_fallocate(fd, 0, max(seq_bytes, writes * write_bytes))
                os.fsync(fd)
                sync_fd = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_DSYNC | os.O_CLOEXEC | os.O_NOFOLLOW)
                try:
                    view = memoryview(buf)[:write_bytes]
                    start = time.perf_counter()
                    for i in range(writes):
                        os.pwrite(sync_fd, view, i * write_bytes)
                    small.append((time.perf_counter() - start) / writes)
                finally:
                    os.close(sync_fd)
                view = memoryview(buf)[:seq_block]
                start = time.perf_counter()
                for offset in range(0, seq_bytes, seq_block):
                    os.pwrite(fd, view, offset)
                os.fdatasync(fd)
                seq.append(seq_bytes / (time.perf_counter() - start))
        finally:
            os.close(fd)
    return WriteRequestProbe(statistics.median(small), statistics.median(seq), write_bytes)
