"""Traffic accounting: every byte crossing each boundary, per layer, decode step and shard.

Interconnect (host <-> storage side) bytes are payload bytes, as INF² Eq. 3 counts them:
- near storage: q, k_new, v_new in; out (in the KV dtype) and lse (float32, kept apart: Eq. 3 leaves it out) back;
- baseline: the KV history read over the link, and the new K/V written back over it;
- prefill K/V (step PREFILL), which both send once.
`x_bytes`: X-cache values the host reads from its own memory to regenerate K/V (not interconnect).
Background spills are counted when they have finished, in the record of the step then running (or FLUSH).
Storage bytes are what the device moves: direct-I/O blocks, padding and rewritten tail blocks included, with the
number of requests, so mean read/write sizes follow.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, fields

from flashllm_ext.kv.files import IOCounters

PREFILL = -1  # the step index of prefill traffic
FLUSH = -2  # the step (and layer) index of what flush() wrote: spills still in flight after the last step, and the rest


@dataclass
class Traffic:
    q_bytes: int = 0
    kv_new_bytes: int = 0
    out_bytes: int = 0
    lse_bytes: int = 0
    kv_read_bytes: int = 0
    writeback_bytes: int = 0
    x_bytes: int = 0
    storage_read_bytes: int = 0
    storage_reads: int = 0
    storage_write_bytes: int = 0
    storage_writes: int = 0

    def interconnect_bytes(self, include_lse: bool = True) -> int:
        """Bytes over the host <-> storage-side link."""
        return (
            self.q_bytes
            + self.kv_new_bytes
            + self.out_bytes
            + self.kv_read_bytes
            + self.writeback_bytes
            + (self.lse_bytes if include_lse else 0)
        )

    @property
    def mean_write_bytes(self) -> float:
        return self.storage_write_bytes / self.storage_writes if self.storage_writes else 0.0

    @property
    def mean_read_bytes(self) -> float:
        return self.storage_read_bytes / self.storage_reads if self.storage_reads else 0.0

    def add(self, other: Traffic) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def add_io(self, io: IOCounters) -> None:
        self.storage_read_bytes += io.bytes_read
        self.storage_reads += io.n_reads
        self.storage_write_bytes += io.bytes_written
        self.storage_writes += io.n_writes


class TrafficLog:
    """Traffic records keyed by (layer, step, shard); `total` sums any selection."""

    def __init__(self):
        self.records: dict[tuple[int, int, int], Traffic] = defaultdict(Traffic)

    def at(self, layer: int, step: int, shard: int) -> Traffic:
        return self.records[(layer, step, shard)]

    def total(
        self,
        *,
        layers: Iterable[int] | None = None,
        steps: Iterable[int] | None = None,
        shards: Iterable[int] | None = None,
    ) -> Traffic:
        """The sum over the records whose layer, step and shard are in the given sets (None: any)."""
        keep = [None if s is None else set(s) for s in (layers, steps, shards)]
        out = Traffic()
        for key, t in self.records.items():
            if all(k is None or v in k for v, k in zip(key, keep)):
                out.add(t)
        return out

    def steps(self) -> list[int]:
        """The decode steps recorded (prefill excluded), in order."""
        return sorted({s for _, s, _ in self.records if s >= 0})

    def clear(self) -> None:
        self.records.clear()
