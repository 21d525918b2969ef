"""NearStorageAttention: the host side of attention near storage (INF² §4).

The (batch, kv head) pairs are split over N shards, one per storage directory, each served by a worker
(kv/worker.py: a process, or `processes=False` for in-process shards). Per layer and decode step the host sends
each shard its slice of q, k_new, v_new, every shard computes attention over its KV on disk + buffer, and the host
gathers (out, lse): the shards hold disjoint (batch, head) pairs, so gathering is placing each slice. Every byte is
counted in `traffic` (kv/traffic.py), and an optional emulated link (kv/link.py) paces the transfers.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from flashllm_ext.kv.backend import AttentionBackend, pair_starts
from flashllm_ext.kv.files import IOCounters
from flashllm_ext.kv.link import Link
from flashllm_ext.kv.store import DTYPES, default_writeback, split_pairs
from flashllm_ext.kv.traffic import FLUSH, PREFILL, TrafficLog
from flashllm_ext.kv.worker import OP_FLUSH, OP_RESET, LocalShard, ShardSpec, ShardWorker, WorkerError


def first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0]


class NearStorageAttention(AttentionBackend):
    """Decode attention of `batch` sequences with `q_heads` query and `kv_heads` kv heads of `head_dim`, over
    `n_layers` layers, KV on storage in len(directories) shards (one worker each).

    writeback: tokens per spill (None: one 4 KiB block per file and spill); scale: multiplies q.k (None:
    1/sqrt(head_dim)); processes: one worker process per shard (False: in this process); link: an emulated
    host <-> storage-side link every transfer goes through (None: unlimited); worker_kwargs: ShardSpec fields
    (block_tokens, prefetch, read_threads, torch_threads, chunk_bytes; storage_gbps and write_request_bytes: each
    worker's emulated device, which paces its reads and its spills).
    """

    def __init__(
        self,
        directories: list[str | os.PathLike],
        *,
        n_layers: int,
        batch: int,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        max_tokens: int,
        writeback: int | None = None,
        scale: float | None = None,
        processes: bool = True,
        link: Link | None = None,
        timeout_s: float = 600.0,
        **worker_kwargs,
    ):
        if q_heads % kv_heads:
            raise ValueError(f"q_heads {q_heads} is not a multiple of kv_heads {kv_heads}")
        dtype_name = next((n for n, d in DTYPES.items() if d == dtype), None)
        if dtype_name is None:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype}")
        self.n_layers, self.batch, self.head_dim = n_layers, batch, head_dim
        self.q_heads, self.kv_heads = q_heads, kv_heads
        self.group, self.dtype, self.link = q_heads // kv_heads, dtype, link
        self.scale = head_dim**-0.5 if scale is None else scale
        self.ranges = split_pairs(batch * kv_heads, len(directories))
        self.traffic = TrafficLog()
        self._step = [0] * n_layers
        self._io = [IOCounters() for _ in self.ranges]
        # set by a failed step: some shards may hold that step's token and others not, so decoding on would
        # attend different histories; flush/close still spill what each shard holds, reset starts afresh
        self._failed: str | None = None
        self.shards: list[ShardWorker | LocalShard] = []
        make = ShardWorker if processes else LocalShard
        try:
            for i, ((p0, p1), directory) in enumerate(zip(self.ranges, directories)):
                c = writeback or default_writeback((p1 - p0) * head_dim * dtype.itemsize)
                spec = ShardSpec(
                    str(Path(directory)),
                    n_layers,
                    p1 - p0,
                    self.group,
                    head_dim,
                    dtype_name,
                    max_tokens,
                    writeback=c,
                    scale=scale,
                    **worker_kwargs,
                )
                self.shards.append(make(spec, timeout_s=timeout_s, name=f"shard{i}"))
        except BaseException:
            self.terminate()
            raise

    @property
    def writeback(self) -> list[int]:
        return [s.spec.writeback for s in self.shards]

    def prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes the prompt's K/V, k / v [batch, kv_heads, s, head_dim], to the shards in bulk."""
        s = k.shape[2]
        flat_k = k.reshape(self.batch * self.kv_heads, s, self.head_dim).to(self.dtype)
        flat_v = v.reshape(self.batch * self.kv_heads, s, self.head_dim).to(self.dtype)
        for i, (shard, (p0, p1)) in enumerate(zip(self.shards, self.ranges)):
            kk = flat_k[p0:p1].transpose(0, 1).contiguous()
            vv = flat_v[p0:p1].transpose(0, 1).contiguous()
            self._transfer(kk.nbytes + vv.nbytes)
            shard.append(layer, kk, vv)
            self.traffic.at(layer, PREFILL, i).kv_new_bytes += kk.nbytes + vv.nbytes
            self._record_io(layer, PREFILL, i)

    def set_starts(self, starts: torch.Tensor | list[int] | None) -> None:
        """Left padding (until reset()): sequence b attends only its tokens from starts[b] on (int [batch], the pad
        tokens in front of it; None: none). Each worker gets its pairs' starts once."""
        per_pair = pair_starts(starts, self.batch, self.kv_heads)
        if per_pair is None:
            per_pair = torch.zeros(self.batch * self.kv_heads, dtype=torch.int64)
        self._all(lambda i, shard: shard.submit_starts(per_pair[slice(*self.ranges[i])]))

    def step(
        self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of `layer`: q [batch, q_heads, D], k_new / v_new [batch, kv_heads, D].
        Returns (out [batch, q_heads, D] float32, lse [batch, q_heads] float32)."""
        self.submit(layer, q, k_new, v_new)
        return self.collect(layer)

    def submit(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        """The first half of step: sends every shard its request and returns at once (the host can compute
        something else, e.g. the X-cache part, while the workers run); collect() gives the result."""
        if self._failed is not None:
            raise WorkerError(
                f"an earlier step failed ({self._failed}); the shards no longer hold the same tokens: "
                f"reset() for a new batch, or close()"
            )
        step = self._step[layer]
        q = q.to(self.dtype).reshape(self.batch * self.kv_heads, self.group, self.head_dim)
        k_new = k_new.to(self.dtype).reshape(self.batch * self.kv_heads, self.head_dim)
        v_new = v_new.to(self.dtype).reshape(self.batch * self.kv_heads, self.head_dim)
        try:
            for i, (shard, (p0, p1)) in enumerate(zip(self.shards, self.ranges)):
                t = self.traffic.at(layer, step, i)
                t.q_bytes += q[p0:p1].nbytes
                t.kv_new_bytes += k_new[p0:p1].nbytes + v_new[p0:p1].nbytes
                self._transfer(q[p0:p1].nbytes + k_new[p0:p1].nbytes + v_new[p0:p1].nbytes)
                shard.submit_step(layer, q[p0:p1], k_new[p0:p1], v_new[p0:p1])
        except BaseException as e:
            self._failed = f"layer {layer}, step {step}: {first_line(e)}"
            self._drain()
            raise

    def collect(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The second half of step: waits for every shard's (out, lse) of `layer`."""
        step = self._step[layer]
        self._step[layer] += 1
        outs, lses = [], []
        try:
            for i, shard in enumerate(self.shards):
                out, lse = shard.step_result()
                t = self.traffic.at(layer, step, i)
                t.out_bytes += out.nbytes
                t.lse_bytes += lse.nbytes
                self._transfer(out.nbytes + lse.nbytes)
                self._record_io(layer, step, i)
                outs.append(out)
                lses.append(lse)
        except BaseException as e:
            self._failed = f"layer {layer}, step {step}: {first_line(e)}"
            self._drain()
            raise
        out = torch.cat(outs).float().reshape(self.batch, self.q_heads, self.head_dim)
        return out, torch.cat(lses).reshape(self.batch, self.q_heads)

    def _transfer(self, nbytes: int) -> None:
        if self.link is not None:
            self.link.transfer(nbytes)

    def _record_io(self, layer: int, step: int, i: int) -> None:
        now = self.shards[i].counters.copy()
        self.traffic.at(layer, step, i).add_io(now.minus(self._io[i]))
        self._io[i] = now

    def _drain(self) -> None:
        """After a failure: collects the replies still owed by the healthy shards, so they stay usable."""
        for shard in self.shards:
            if getattr(shard, "_inflight", None) is not None:
                try:
                    shard.wait()
                except Exception:
                    pass

    def _each(self, op: int | Callable[[int, ShardWorker | LocalShard], None]) -> list[WorkerError | None]:
        """op (or submit(i, shard)) on every shard, every reply collected (a shard whose reply were left pending
        would refuse the next request); a shard that fails or is dead does not keep the others from running it.
        Returns each shard's error (None: done)."""
        errors: list[WorkerError | None] = [None] * len(self.shards)
        try:
            for i, shard in enumerate(self.shards):
                try:
                    if callable(op):
                        op(i, shard)
                    else:
                        shard.submit(op)
                except WorkerError as e:
                    errors[i] = e
        except BaseException:
            self._drain()
            raise
        for i, shard in enumerate(self.shards):
            if errors[i] is None:
                try:
                    shard.wait()
                except WorkerError as e:
                    errors[i] = e
        return errors

    def _all(self, op: int | Callable[[int, ShardWorker | LocalShard], None]) -> None:
        """_each, raising the first error."""
        error = next((e for e in self._each(op) if e is not None), None)
        if error is not None:
            raise error

    def flush(self) -> None:
        """Every shard spills its buffer (raises WorkerError naming a shard whose spill failed)."""
        error = next((e for e in self._flush_each() if e is not None), None)
        if error is not None:
            raise error

    def _flush_each(self) -> list[WorkerError | None]:
        """OP_FLUSH on every shard (_each), the writes recorded in `traffic`."""
        errors = self._each(OP_FLUSH)
        for i in range(len(self.shards)):
            self._record_io(FLUSH, FLUSH, i)
        return errors

    def reset(self) -> None:
        """Forgets every token and the padding (a new batch); the traffic log is cleared too."""
        self._all(OP_RESET)
        self._failed = None
        self._step = [0] * self.n_layers
        self._io = [s.counters.copy() for s in self.shards]
        self.traffic.clear()

    def close(self) -> None:
        """Spills (recording the writes in `traffic`) and stops every worker. A failed spill raises with every
        worker still up (nothing lost; close() again retries). A dead worker does not keep the others from spilling
        and stopping: it is named in the WorkerError raised after (its buffered tokens are lost). A failure to stop
        one is raised after stopping the others."""
        errors = self._flush_each()
        failed = [e for e, shard in zip(errors, self.shards) if e is not None and shard.dead is None]
        if failed:
            raise failed[0]
        dead = [shard.dead for shard in self.shards if shard.dead is not None]
        error = None
        for shard in self.shards:
            try:
                shard.close()
            except Exception as e:
                error = error or e
        self.shards = []
        if dead:
            raise WorkerError(
                f"{'; '.join(dead)} (a dead worker's buffered tokens are lost; every other shard was "
                "spilled and closed)"
            )
        if error is not None:
            raise error

    def terminate(self) -> None:
        """Stops every worker without spilling (after a failure)."""
        for shard in self.shards:
            shard.terminate()
        self.shards = []
