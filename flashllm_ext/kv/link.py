"""Interconnect and storage bandwidth emulation for scaling studies (INF² Figures 3c and 16): a token bucket.

`Link(gbps)` paces the bytes that cross it: a transfer of n bytes waits until the bucket holds n tokens, refilled
at `gbps` x 10^9 / 8 bytes per second up to `burst_bytes`. Thread safe, so N workers (or N shards' transfers)
behind one shared `Link` share its bandwidth, as devices behind one PCIe switch do.
"""
from __future__ import annotations

import threading
import time


class Link:
    """A token-bucket bandwidth limit of `gbps` gigabits per second; `transferred` counts the bytes paced."""

    def __init__(self, gbps: float, burst_bytes: int = 256 << 10):
        if gbps <= 0:
            raise ValueError(f"gbps must be positive, got {gbps}")
        self.gbps, self.burst_bytes = gbps, burst_bytes
        self.bytes_per_s = gbps * 1e9 / 8
        self.transferred = 0
        self._tokens = float(burst_bytes)
        self._last = time.perf_counter()
        self._lock = threading.Lock()

    def transfer(self, nbytes: int) -> None:
        """Blocks until `nbytes` may cross (the bucket may go negative: a transfer larger than the burst waits for
        its whole size, and later ones queue behind it)."""
        with self._lock:
            now = time.perf_counter()
            self._tokens = min(self.burst_bytes, self._tokens + (now - self._last) * self.bytes_per_s)
            self._last = now
            self._tokens -= nbytes
            self.transferred += nbytes
            wait = -self._tokens / self.bytes_per_s if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)

    def __repr__(self) -> str:
        return f"Link({self.gbps:g} Gb/s)"
