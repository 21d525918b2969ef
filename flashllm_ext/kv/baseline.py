"""HostKVAttention: FlexGen's disk-KV decoding, done well, as the baseline of attention near storage.

The host owns the KV shards (the same files, layout, striping over the same directories and delayed writeback as
near storage) and computes attention itself: every step it reads each layer's whole KV history from storage with
direct I/O, the next layer's history being read on a background thread while this layer computes (FlexGen's
overlap of I/O and compute), and runs the same native kernel over it. What differs from near storage is only where
attention runs, so the comparison isolates what INF² changes: the history crosses the interconnect every step.

The prefetch holds one layer's history in memory (2 x context x batch x kv heads x head_dim values); size the run
so that fits, as FlexGen sizes its GPU buffers.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from flashllm_ext import ops
from flashllm_ext.kv.attention import DEFAULT_BLOCK_BYTES, masked_decode_attention
from flashllm_ext.kv.backend import AttentionBackend, pair_starts
from flashllm_ext.kv.files import IOCounters
from flashllm_ext.kv.link import Link
from flashllm_ext.kv.store import KVShard, KVView, split_pairs
from flashllm_ext.kv.traffic import FLUSH, PREFILL, TrafficLog


class HostKVAttention(AttentionBackend):
    """Same constructor arguments and interface as NearStorageAttention (prefill, step, flush, reset, close,
    traffic), attention computed on the host. link: the emulated interconnect the history and the writeback cross;
    storage_gbps: emulated bandwidth of each directory's device, which paces its reads and its spills;
    write_request_bytes: that device's least charge per write request (kv/link.py)."""

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
        link: Link | None = None,
        storage_gbps: float | None = None,
        write_request_bytes: int = 0,
        read_threads: int = 4,
    ):
        if q_heads % kv_heads:
            raise ValueError(f"q_heads {q_heads} is not a multiple of kv_heads {kv_heads}")
        self.n_layers, self.batch, self.head_dim = n_layers, batch, head_dim
        self.q_heads, self.kv_heads = q_heads, kv_heads
        self.group, self.dtype, self.link = q_heads // kv_heads, dtype, link
        self.scale = head_dim**-0.5 if scale is None else scale
        self.ranges = split_pairs(batch * kv_heads, len(directories))
        self.storage_links = [
            None if storage_gbps is None else Link(storage_gbps, request_bytes=write_request_bytes) for _ in self.ranges
        ]
        self.shards: list[KVShard] = []
        try:
            for (p0, p1), d, device in zip(self.ranges, directories, self.storage_links):
                self.shards.append(
                    KVShard.create(
                        Path(d),
                        n_layers,
                        p1 - p0,
                        head_dim,
                        dtype,
                        max_tokens,
                        writeback=writeback,
                        read_threads=read_threads,
                        device=device,
                    )
                )
        except BaseException:
            for s in self.shards:
                s.abandon()
            raise
        self.traffic = TrafficLog()
        self._step = [0] * n_layers
        self._io = [IOCounters() for _ in self.shards]
        # per shard its own reader thread: the devices are read in parallel, as FlexGen stripes its KV files
        self._readers = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashllm-kv-prefetch") for _ in self.shards
        ]
        self._prefetch: dict[int, list[Future]] = {}
        self._starts: torch.Tensor | None = None  # per pair (left padding)

    @property
    def writeback(self) -> list[int]:
        return [s.writeback for s in self.shards]

    def prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes the prompt's K/V, k / v [batch, kv_heads, s, head_dim], to storage in bulk."""
        s = k.shape[2]
        flat_k = k.reshape(self.batch * self.kv_heads, s, self.head_dim).to(self.dtype)
        flat_v = v.reshape(self.batch * self.kv_heads, s, self.head_dim).to(self.dtype)
        for i, (shard, (p0, p1)) in enumerate(zip(self.shards, self.ranges)):
            kk, vv = flat_k[p0:p1].transpose(0, 1).contiguous(), flat_v[p0:p1].transpose(0, 1).contiguous()
            if self.link is not None:
                self.link.transfer(kk.nbytes + vv.nbytes)
            shard.append(layer, kk, vv)
            self.traffic.at(layer, PREFILL, i).writeback_bytes += kk.nbytes + vv.nbytes
            self._record_io(layer, PREFILL, i)

    def _read(self, i: int, layer: int, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [t0, t1) of shard i, in blocks of about DEFAULT_BLOCK_BYTES per file: each block crosses the
        device and then the link, so with emulated bandwidths the shards' blocks pipeline through the shared link
        as the workers' blocks do (a whole-history transfer would serialise device and link time)."""
        shard = self.shards[i]
        shape = (t1 - t0, shard.pairs, self.head_dim)
        k, v = torch.empty(shape, dtype=self.dtype), torch.empty(shape, dtype=self.dtype)
        block = max(1, DEFAULT_BLOCK_BYTES // shard.token_bytes)
        for b0 in range(t0, t1, block):
            b1 = min(b0 + block, t1)
            kb, vb = k[b0 - t0 : b1 - t0], v[b0 - t0 : b1 - t0]
            shard.read(layer, b0, b1, kb, vb)
            for link in (self.storage_links[i], self.link):
                if link is not None:
                    link.transfer(kb.nbytes + vb.nbytes)
        return k, v

    def _start_prefetch(self, layer: int) -> None:
        if layer in self._prefetch:
            return
        self._prefetch[layer] = [
            self._readers[i].submit(lambda i=i, d=shard.view(layer).disk_len: (d, *self._read(i, layer, 0, d)))
            for i, shard in enumerate(self.shards)
        ]

    def _history(self, i: int, layer: int, view: KVView, prefetched: Future):
        """Disk rows [0, view.disk_len) of shard i: the prefetched ones plus any spilled since the prefetch."""
        d, k, v = prefetched.result()
        if d < view.disk_len:
            k2, v2 = self._read(i, layer, d, view.disk_len)
            k, v = torch.cat([k, k2]), torch.cat([v, v2])
        return k, v

    def set_starts(self, starts: torch.Tensor | list[int] | None) -> None:
        """Left padding (until reset()): sequence b attends only its tokens from starts[b] on (None: no padding)."""
        self._starts = pair_starts(starts, self.batch, self.kv_heads)

    def step(
        self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of `layer`: q [batch, q_heads, D], k_new / v_new [batch, kv_heads, D].
        Returns (out [batch, q_heads, D] float32, lse [batch, q_heads] float32)."""
        step = self._step[layer]
        self._step[layer] += 1
        q = q.to(self.dtype).reshape(self.batch * self.kv_heads, self.group, self.head_dim)
        k_new = k_new.to(self.dtype).reshape(self.batch * self.kv_heads, 1, self.head_dim)
        v_new = v_new.to(self.dtype).reshape(self.batch * self.kv_heads, 1, self.head_dim)
        views = []
        for i, (shard, (p0, p1)) in enumerate(zip(self.shards, self.ranges)):
            kk, vv = k_new[p0:p1].transpose(0, 1), v_new[p0:p1].transpose(0, 1)
            views.append(shard.append(layer, kk.contiguous(), vv.contiguous()))
            # the new token crosses the link once, when it is written back (FlexGen stores it every step)
            self.traffic.at(layer, step, i).writeback_bytes += kk.nbytes + vv.nbytes
            if self.link is not None:
                self.link.transfer(kk.nbytes + vv.nbytes)
        prefetched = self._prefetch.pop(layer, None)
        if prefetched is None:  # the first step of a layer: read the shards now, in parallel
            prefetched = [
                self._readers[i].submit(lambda i=i, d=view.disk_len: (d, *self._read(i, layer, 0, d)))
                for i, view in enumerate(views)
            ]
        histories = [self._history(i, layer, view, prefetched[i]) for i, view in enumerate(views)]
        # the next layer's read starts once this layer's is in, so the two never share the link or the devices;
        # it overlaps this layer's attention and everything up to the next layer's step
        self._start_prefetch((layer + 1) % self.n_layers)
        outs, lses = [], []
        for i, ((p0, p1), view, (k, v)) in enumerate(zip(self.ranges, views, histories)):
            self.traffic.at(layer, step, i).kv_read_bytes += k.nbytes + v.nbytes
            starts = None if self._starts is None else self._starts[p0:p1]
            parts = [
                masked_decode_attention(q[p0:p1], k.unsqueeze(2), v.unsqueeze(2), scale=self.scale, starts=starts),
                masked_decode_attention(
                    q[p0:p1],
                    view.k_buf.unsqueeze(2),
                    view.v_buf.unsqueeze(2),
                    scale=self.scale,
                    starts=starts,
                    t0=view.disk_len,
                ),
            ]
            out, lse = ops.merge_attention_states(
                torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
            )
            outs.append(out)
            lses.append(lse)
            self._record_io(layer, step, i)
        return (
            torch.cat(outs).reshape(self.batch, self.q_heads, self.head_dim),
            torch.cat(lses).reshape(self.batch, self.q_heads),
        )

    def _record_io(self, layer: int, step: int, i: int) -> None:
        now = self.shards[i].counters().copy()
        self.traffic.at(layer, step, i).add_io(now.minus(self._io[i]))
        self._io[i] = now

    def _drop_prefetch(self) -> None:
        for futures in self._prefetch.values():
            for f in futures:
                f.exception()  # wait; a failed prefetch is simply read again
        self._prefetch.clear()

    def flush(self) -> None:
        for i, shard in enumerate(self.shards):
            shard.flush()
            self._record_io(FLUSH, FLUSH, i)

    def reset(self) -> None:
        self._drop_prefetch()
        for shard in self.shards:
            shard.reset()
        self._starts = None
        self._step = [0] * self.n_layers
        self._io = [s.counters().copy() for s in self.shards]
        self.traffic.clear()

    def close(self) -> None:
        """Spills (recording the writes in `traffic`), then closes the shards; a failed spill raises first."""
        self._drop_prefetch()
        self.flush()
        for reader in self._readers:
            reader.shutdown(wait=True)
        for shard in self.shards:
            shard.close()

    def terminate(self) -> None:
        self._drop_prefetch()
        for shard in self.shards:
            shard.abandon()
