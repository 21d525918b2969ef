"""ShardAttention: decode attention of one shard over its KV on disk plus its writeback buffer.

This is what runs next to the storage (in a worker process, kv/worker.py, or in-process for tests): it owns a
KVShard, appends each step's new K/V, and computes attention block by block: the disk rows are read in blocks with
direct I/O on a reader thread, block i + 1's read overlapping block i's compute (`ops.decode_attention`), the
partial results combined with the exact log-sum-exp merge (`ops.merge_attention_states`), the buffer last.
The shard's pairs play the batch role of the kernel: q [pairs, group, D] against k [S, pairs, 1, D], so query head
j of a pair reads that pair's kv head (GQA/MQA with group = Hq / Hkv).

Left-padded batches: `starts[p]` is the first token pair p attends (its sequence's padding before it). The kernel
has no mask; `masked_decode_attention` runs it per group of pairs sharing a start over the rows each may see, so a
padded position never enters a softmax (only blocks that reach into the padding pay for the split).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from flashllm_ext import ops
from flashllm_ext.kv.link import Link
from flashllm_ext.kv.store import KVShard, KVView

DEFAULT_BLOCK_BYTES = 1 << 20  # per file and block: large direct reads, two blocks of K and V in flight at most


def masked_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None,
    starts: torch.Tensor | None = None,
    t0: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.decode_attention(q, k, v)` (q [B, Hq, D], k / v [S, B, Hkv, D]) where k[i] is token t0 + i and batch
    row b attends only tokens >= starts[b] (starts: int64 [B], None: every token). Rows that see no token of this
    range get out 0, lse -inf (what merge_attention_states drops)."""
    if starts is None or int(starts.max()) <= t0:
        return ops.decode_attention(q, k, v, scale=scale)
    n = k.shape[0]
    skip = (starts - t0).clamp(0, n)
    out = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full(q.shape[:2], float("-inf"))
    for first in skip.unique().tolist():
        if first == n:
            continue
        rows = (skip == first).nonzero().squeeze(1)
        out[rows], lse[rows] = ops.decode_attention(q[rows], k[first:, rows], v[first:, rows], scale=scale)
    return out, lse


class ShardAttention:
    """Attention over one KVShard. group: query heads per kv head; scale: multiplies q.k (None: 1/sqrt(D));
    block_tokens: disk rows per read (None: about DEFAULT_BLOCK_BYTES per file); prefetch: overlap the next
    block's read with this block's compute (False: read, then compute, for comparison); storage_link: an emulated
    storage bandwidth limit every block read goes through (kv/link.py)."""

    def __init__(
        self,
        shard: KVShard,
        *,
        group: int,
        scale: float | None = None,
        block_tokens: int | None = None,
        prefetch: bool = True,
        storage_link: Link | None = None,
    ):
        if group < 1:
            raise ValueError(f"group must be >= 1, got {group}")
        self.shard, self.group, self.scale, self.prefetch = shard, group, scale, prefetch
        self.storage_link = storage_link
        self.block_tokens = block_tokens or max(1, DEFAULT_BLOCK_BYTES // shard.token_bytes)
        shape = (self.block_tokens, shard.pairs, shard.head_dim)
        self._blocks = [
            (torch.empty(shape, dtype=shard.dtype), torch.empty(shape, dtype=shard.dtype)) for _ in range(2)
        ]
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashllm-kv-read")
        self.starts: torch.Tensor | None = None

    def set_starts(self, starts: torch.Tensor | None) -> None:
        """Left padding: pair p attends only tokens >= starts[p] (int64 [pairs]; None: no padding)."""
        if starts is not None:
            starts = torch.as_tensor(starts, dtype=torch.int64).reshape(-1)
            if starts.numel() != self.shard.pairs or bool((starts < 0).any()):
                raise ValueError(f"starts must be {self.shard.pairs} non-negative token indices, got {starts.tolist()}")
            if not bool(starts.any()):
                starts = None
        self.starts = starts

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> KVView:
        """Adds tokens k, v [n, pairs, head_dim] (a prefill chunk, or one decode step)."""
        return self.shard.append(layer, k, v)

    def step(
        self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step: appends k_new, v_new [pairs, head_dim] and returns attention of q [pairs, group, D]
        over every token, the new one included: (out [pairs, group, D] float32, lse [pairs, group] float32)."""
        view = self.shard.append(layer, k_new.unsqueeze(0), v_new.unsqueeze(0))
        return self.attend(view, q)

    def attend(self, view: KVView, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of q [pairs, group, D] over the view's disk rows and buffer."""
        expected = (self.shard.pairs, self.group, self.shard.head_dim)
        if tuple(q.shape) != expected:
            raise ValueError(f"q must be {list(expected)} (pairs, group, head_dim), got {list(q.shape)}")
        q = q.to(self.shard.dtype)
        ranges = [(t0, min(t0 + self.block_tokens, view.disk_len)) for t0 in range(0, view.disk_len, self.block_tokens)]
        out, lse = self.attend_rows(q, view.k_buf, view.v_buf, view.disk_len)
        pending = self._read(view.layer, ranges[0], 0) if ranges else None
        for i in range(len(ranges)):
            k, v = pending.result() if self.prefetch else pending
            if i + 1 < len(ranges):
                pending = self._read(view.layer, ranges[i + 1], (i + 1) % 2)
            out, lse = self._merge(out, lse, *self.attend_rows(q, k, v, ranges[i][0]))
        return out, lse

    def _read(self, layer: int, rows: tuple[int, int], slot: int):
        """Reads disk rows into block buffer `slot`: a future (prefetch) or the (k, v) views themselves."""
        n = rows[1] - rows[0]
        k, v = self._blocks[slot][0][:n], self._blocks[slot][1][:n]

        def read():
            self.shard.read(layer, rows[0], rows[1], k, v)
            if self.storage_link is not None:
                self.storage_link.transfer(k.nbytes + v.nbytes)
            return k, v

        return self._reader.submit(read) if self.prefetch else read()

    def attend_rows(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t0: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of q [pairs, group, D] over rows k, v [n, pairs, D] in memory holding tokens t0.. (what attend
        computes for each block it reads; no I/O): (out [pairs, group, D] float32, lse [pairs, group] float32)."""
        return masked_decode_attention(q, k.unsqueeze(2), v.unsqueeze(2), scale=self.scale, starts=self.starts, t0=t0)

    @staticmethod
    def _merge(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.merge_attention_states(torch.stack([out_a, out_b]), torch.stack([lse_a, lse_b]))

    def close(self) -> None:
        """Stops the reader thread (the shard is the caller's to close)."""
        self._reader.shutdown(wait=True)
