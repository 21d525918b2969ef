"""NeuronCache: the DRAM side of "LLM in a flash" for one FFN layer.

The cache holds, preallocated once, the bundles of the neurons active in the last `window` tokens:
  matrix   [capacity, row_width]     one neuron's bundle [up | gate (GLU) | down] per row, as the store holds it
                                     (floats, or a quantized store's uint8 blocks)
  pointer  [capacity] int64          neuron id of each row; rows [0, num_used) are in use, the rest hold -1
  bias     [capacity] or None        the input projection's bias of each row's neuron (OPT's fc1.bias), moved
                                     with its row; None for bias-free models (Llama family)
  slot_of  [n_neurons] int64         row of each neuron, -1 when not cached (the inverse of pointer)
  last_active [n_neurons] int64      the last step each neuron was active: the active sets of the last `window`
                                     tokens are {n : last_active[n] > step - window}, which is also the recency
                                     order the budget rule needs
`step(active_ids)` evicts rows whose neuron left the window by swap-delete (the last used rows move into the
holes, ops.cache_compact), reads the missing bundles with FlashReader straight into the free rows at the end, and
appends their ids. Rows [0, num_used) then feed ops.sparse_ffn. Over an Endor store the reader decompresses each
missing neuron's compressed row straight into its free cache row (endor_decompress(rows=..., out=...)), so the
cache holds dense bundles and reads ~56% of the bytes at 50% sparsity.

On a GPU (device="cuda", or any flashllm_ext.flash.transfer.StagedTransfer) matrix, bias and `device_pointer` live on the
device; pointer, slot_of and last_active stay in host memory as the mirror every decision is made on (cache_plan and a
swap-delete of the mirror, on the CPU), so no step waits on the device. The same rows are then swap-deleted on the
device (ops.cache_compact's CUDA kernel), the missing bundles are read into the transfer's pinned staging buffer and
copied to their rows on a copy stream; events order that copy after the compaction and before the compute that uses
the rows (flashllm_ext/flash/transfer.py). Row order, and so every row's content, is the CPU cache's.

Capacity comes from a byte budget (or is given); when the window's union does not fit, the least recently active
rows that the current token does not need are evicted early and counted in StepStats.evicted_budget. A token
whose own active set exceeds the capacity raises ValueError. After construction a step allocates no tensor memory.

Pinned neurons (the engine's hot set, `pinned_ids`) are read once at construction and never leave: a step drops
them from its set before planning, so their last_active stays at _PINNED, past every window and last in the
budget's least-recently-active order. The other neurons share the `step_capacity` rows left. (Dropping them takes a
few small tensors a step: the no-allocation property holds for caches without pins.)
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from flashllm_ext import ops
from flashllm_ext.flash.reader import FlashReader, ReadResult, shared_reader
from flashllm_ext.flash.store import FlashStore
from flashllm_ext.flash.transfer import Transfer, make_transfer

_NEVER = -(1 << 62)  # last_active of a neuron never seen: outside every window
_PINNED = 1 << 62  # last_active of a pinned neuron: inside every window, the most recent for the budget rule


@dataclass(frozen=True)
class StepStats:
    """What one NeuronCache.step did."""

    evicted: int  # rows that left because their neuron was not active in the last `window` tokens
    evicted_budget: int  # rows evicted early (least recently active first) because the window's union did not fit
    inserted: int  # bundles read from flash
    bytes_read: int  # bytes the reader read (alignment padding and coalesced gaps included)
    io_s: float  # time spent waiting for the reads (all of the read time unless the step was begun in the background)
    mem_s: float  # time in memory management: planning, swap-delete compaction, pointer/bias bookkeeping (on a
    # device: its compaction and the copy of the new rows from the staging buffer included)
    num_used: int  # rows in use after the step
    hidden_io_s: float = 0.0  # read time that overlapped other work (begin_step(background=True) ... finish)
    decompress_s: float = 0.0  # Endor stores: the part of the read time spent decompressing into the cache rows
    bytes_requested: int = 0  # bytes of the bundles read (compressed for Endor), without padding or coalesced gaps
    n_reads: int = 0  # read requests the reader issued (after coalescing)

    @property
    def total_evicted(self) -> int:
        return self.evicted + self.evicted_budget


def input_bias_role(store: FlashStore) -> str:
    """The role of the bias added before the activation: a GLU gate's (Llama mlp_bias gate_proj.bias), else the up
    projection's (OPT's fc1.bias)."""
    return "gate_bias" if store.glu else "up_bias"


def layer_input_bias(store: FlashStore, layer: int) -> torch.Tensor | None:
    """The per-neuron bias of layer `layer`'s activation input ([n_neurons], store dtype) from the resident file;
    None when the model has none. A GLU model's up_proj bias has no place in the bundle kernel and raises
    ValueError."""
    if store.glu and store.layer_bias(layer, "up_bias") is not None:
        raise ValueError(f"{store.path}: layer {layer} has an up_proj bias, which sparse_ffn does not support")
    bias = store.layer_bias(layer, input_bias_role(store))
    return None if bias is None else bias.to(store.dtype)


class NeuronCache:
    """Cache of one FFN layer's active neuron bundles over a preallocated pointer matrix (see the module doc).

    store: FlashStore (or its path). capacity: rows; or budget_bytes: the byte budget of everything the cache
    holds (matrix, pointer, bias, per-neuron state, scratch), from which the capacity follows. window: tokens.
    reader: the FlashReader to read bundles with (default: the store's shared one, shared_reader(store)).
    device: where the rows live ("cpu" or "cuda"); transfer: the flashllm_ext.flash.transfer object that places them
    (default: a new one for `device`; a model's caches share one). pinned_ids: int64 [h] distinct neurons held in
    rows from construction on and never evicted (fewer than the capacity).
    """

    def __init__(
        self,
        store: FlashStore | str | os.PathLike,
        layer: int,
        capacity: int | None = None,
        window: int = 5,
        *,
        budget_bytes: int | None = None,
        reader: FlashReader | None = None,
        device: str | torch.device | None = None,
        transfer: Transfer | None = None,
        pinned_ids: torch.Tensor | None = None,
    ):
        self.store = store if isinstance(store, FlashStore) else FlashStore(store)
        if not 0 <= layer < self.store.n_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.store.n_layers})")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.layer, self.window = layer, window
        n = self.store.n_neurons
        bias_all = layer_input_bias(self.store, layer)
        if transfer is None:
            transfer = make_transfer(device or "cpu")
        elif device is not None and torch.device(device) != transfer.device:
            raise ValueError(f"device {device} disagrees with the transfer's {transfer.device}")
        self.transfer, self.device = transfer, transfer.device
        fixed, per_row = self.bytes_for(self.store, with_bias=bias_all is not None, staged=transfer.staged)
        if (capacity is None) == (budget_bytes is None):
            raise ValueError("give exactly one of capacity and budget_bytes")
        if budget_bytes is not None:
            capacity = min(n, max(0, (budget_bytes - fixed) // per_row))
            if capacity < 1:
                raise ValueError(
                    f"budget_bytes={budget_bytes} cannot hold one row ({fixed} bytes of per-neuron "
                    f"state + {per_row} bytes per row)"
                )
        if not 1 <= capacity <= n:
            raise ValueError(f"capacity must be in [1, n_neurons={n}], got {capacity}")
        self.capacity = capacity
        self.matrix = transfer.empty((capacity, self.store.row_width), self.store.row_dtype).zero_()
        self.pointer = torch.full((capacity,), -1, dtype=torch.int64)
        # The device's copy of the pointer; on the CPU the same tensor. The host mirror, `pointer`, is planned on.
        self.device_pointer = transfer.empty((capacity,), torch.int64).fill_(-1) if transfer.staged else self.pointer
        self.bias = None if bias_all is None else transfer.empty((capacity,), self.store.dtype).zero_()
        # The host mirror's swap-delete moves pointer and slot_of only: a matrix of rows 0 bytes wide.
        self._mirror_rows = torch.empty((capacity, 0), dtype=torch.uint8) if transfer.staged else None
        if transfer.staged:
            transfer.reserve(capacity * self.store.row_bytes)
        self._bias_all = bias_all
        self.slot_of = torch.full((n,), -1, dtype=torch.int64)
        self.last_active = torch.full((n,), _NEVER, dtype=torch.int64)
        self._evict_rows = torch.empty(capacity, dtype=torch.int64)
        self._missing = torch.empty(capacity, dtype=torch.int64)
        self._row_ids = torch.arange(capacity, dtype=torch.int64)
        self.nbytes = fixed + per_row * capacity
        self.num_used = 0
        self.steps = 0
        self.reader = reader if reader is not None else shared_reader(self.store)
        self.pinned = torch.zeros(n, dtype=torch.bool)  # neurons that never leave (all False: none)
        self.step_capacity = capacity  # rows the unpinned neurons share
        if pinned_ids is not None and pinned_ids.numel():
            self._pin(pinned_ids)

    def _pin(self, ids: torch.Tensor) -> None:
        ids = self.store.check_ids(ids)
        if ids.unique().numel() != ids.numel() or ids.numel() >= self.capacity:
            raise ValueError(
                f"pinned_ids must be distinct and fewer than the capacity ({self.capacity}), got {ids.numel()}"
            )
        self.begin_step(ids).finish()
        self.pinned[ids] = True
        self.last_active[ids] = _PINNED
        self.step_capacity, self.steps = self.capacity - ids.numel(), 0

    @property
    def n_pinned(self) -> int:
        return self.capacity - self.step_capacity

    def partition(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the pinned ones of neuron `ids`, the others), each in the order given."""
        if not self.n_pinned:
            return ids[:0], ids
        pinned = self.pinned[ids]
        return ids[pinned], ids[~pinned]

    @staticmethod
    def bytes_for(store: FlashStore, with_bias: bool, staged: bool = False) -> tuple[int, int]:
        """(fixed bytes, bytes per row) of a cache over `store`: per-neuron state (slot_of, last_active, the
        pinned mask, the resident bias vector) and per row (bundle, pointer, bias, two int64 scratch entries, a row
        id; staged on a device: the device's pointer too). The transfer's shared staging buffer is counted by its
        owner."""
        item = store.dtype.itemsize
        fixed = store.n_neurons * (8 + 8 + 1 + (item if with_bias else 0))
        per_row = store.row_bytes + 8 * (5 if staged else 4) + (item if with_bias else 0)
        return fixed, per_row

    def step(self, active_ids: torch.Tensor) -> StepStats:
        """Make the cache hold the neurons active in the last `window` tokens, this token's `active_ids` (int64
        [k], any order, repeats allowed, in [0, n_neurons)) included. Raises ValueError, changing nothing, for ids
        out of range or more distinct unpinned ids than the step capacity."""
        return self.begin_step(active_ids).finish()

    def begin_step(self, active_ids: torch.Tensor, background: bool = False, same_token: bool = False) -> PendingStep:
        """The first half of `step`: plan, evict (swap-delete) and start reading the missing bundles, in a reader
        thread if `background`. Until `finish()`, rows [0, num_used) hold the neurons that were already cached
        (their slot_of is valid; the missing ids still map to -1), so work on them overlaps the reads.
        same_token: a second step for the token of the last one (which read a set chosen ahead; this one the set
        the token needs): the window does not move, and the last step's neurons outside `active_ids` count as the
        previous token's, so they leave first when the budget is short."""
        if not isinstance(active_ids, torch.Tensor) or active_ids.dtype != torch.int64 or active_ids.dim() != 1:
            raise ValueError("active_ids must be a 1-D int64 tensor")
        if active_ids.device.type != "cpu":
            raise ValueError(f"active_ids must be on the CPU, got {active_ids.device}")
        t0 = time.perf_counter()
        if self.n_pinned:  # cached for good: nothing to plan (and their last_active stays _PINNED)
            active_ids = self.store.check_ids(active_ids)
            active_ids = active_ids[~self.pinned[active_ids]]
            if active_ids.numel() > self.step_capacity and active_ids.unique().numel() > self.step_capacity:
                raise ValueError(
                    f"{active_ids.unique().numel()} distinct unpinned neurons do not fit the "
                    f"{self.step_capacity} rows the {self.n_pinned} pinned ones leave; raise the byte budget"
                )
        step = self.steps if same_token else self.steps + 1
        if same_token and self.steps:
            self._spare_last_step(active_ids)
        try:
            n_window, n_budget, n_missing = ops.cache_plan(
                active_ids,
                self.last_active,
                self.slot_of,
                self.pointer,
                self._evict_rows,
                self._missing,
                num_used=self.num_used,
                step=step,
                window=self.window,
            )
        except RuntimeError as e:
            raise ValueError(str(e)) from None
        self.steps = step
        evict = self._evict_rows[: n_window + n_budget]
        if self.transfer.staged:  # the mirror first (host), then the same moves on the device, queued
            kept = ops.cache_compact(
                self._mirror_rows, self.pointer, evict, num_used=self.num_used, slot_of=self.slot_of
            )
            self.transfer.compact(self.matrix, self.device_pointer, evict, num_used=self.num_used, bias=self.bias)
        else:
            kept = ops.cache_compact(
                self.matrix, self.pointer, evict, num_used=self.num_used, bias=self.bias, slot_of=self.slot_of
            )
        # Rows [kept, kept + n_missing) are free after the compaction. The new neurons are recorded only once their
        # bundles are in (PendingStep.finish): a failed read leaves a consistent cache of `kept` rows, and the next
        # step retries them.
        self.num_used = kept
        ids = self._missing[:n_missing]
        out = (
            self.transfer.staging((n_missing, self.store.row_width), self.store.row_dtype)
            if self.transfer.staged
            else self.matrix[kept : kept + n_missing]
        )
        mem_s = self.transfer.clock() - t0
        read: Future | ReadResult | None = None
        if n_missing:
            read = (
                self.reader.read_async(self.layer, ids, out) if background else self.reader.read(self.layer, ids, out)
            )
        return PendingStep(self, n_window, n_budget, ids, read, mem_s)

    def serve(self, layer: int, input_bias: torch.Tensor | None) -> None:
        """Hold `layer`'s neurons from now on, `input_bias` [n_neurons] its activation input's bias (None: none;
        layer_input_bias). For one cache whose rows every layer of a model uses in turn (the engine's shared cache
        layout): every row is dropped (no bundle is read or moved; the next step reads its whole set), since
        another layer has overwritten them since this layer's last step."""
        if not 0 <= layer < self.store.n_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.store.n_layers})")
        if self.n_pinned:
            raise ValueError("a cache with pinned neurons holds one layer's: it cannot serve another")
        if (input_bias is None) != (self._bias_all is None):
            raise ValueError(
                f"layer {layer}'s input bias is {'absent' if input_bias is None else 'present'}, "
                f"unlike layer {self.layer}'s"
            )
        self._drop_rows()
        self.last_active.fill_(_NEVER)
        self.layer, self._bias_all = layer, input_bias

    def load(self, ids: torch.Tensor) -> StepStats:
        """Read the distinct neurons `ids` (int64 [k] on the CPU, in range, k <= capacity) into rows [0, k) in their
        order, with their input bias rows, for the computation that follows: the step of a cache whose rows the
        layers of a model use in turn (the shared layout, after `serve`). The next layer overwrites the rows before
        any lookup could hit them, so nothing is planned, swap-deleted or recorded: the cache holds no neuron
        afterwards (num_used 0, no slot, no window entry), and rows it held before (a step's) are dropped, counted
        as budget evictions. Host memory and no pinned neurons only."""
        if self.transfer.staged or self.n_pinned:
            raise ValueError("load reads a set into a shared cache's rows: host memory, no pinned neurons")
        k = ids.numel()
        if k > self.capacity:
            raise ValueError(f"{k} neurons do not fit the {self.capacity} rows; raise the byte budget")
        t0 = time.perf_counter()
        dropped = self._drop_rows()
        self.steps += 1
        if self.bias is not None and k:
            torch.index_select(self._bias_all, 0, ids, out=self.bias[:k])
        mem_s = time.perf_counter() - t0
        if not k:
            return StepStats(0, dropped, 0, 0, 0.0, mem_s, 0)
        read = self.reader.read(self.layer, ids, self.matrix[:k]).stats
        return StepStats(
            0,
            dropped,
            k,
            read.bytes_read,
            read.wall_s,
            mem_s,
            k,
            decompress_s=read.decompress_s,
            bytes_requested=read.bytes_requested,
            n_reads=read.n_reads,
        )

    def _drop_rows(self) -> int:
        """Empty rows [0, num_used) (no bundle moved or read); how many there were."""
        if not self.num_used:
            return 0
        held = self.pointer[: self.num_used]
        self.slot_of.index_fill_(0, held, -1)
        held.fill_(-1)
        dropped, self.num_used = self.num_used, 0
        return dropped

    def _spare_last_step(self, active_ids: torch.Tensor) -> None:
        """Mark the cached neurons of the last step that are not in active_ids as active one step earlier."""
        cached = self.pointer[: self.num_used]
        wanted = torch.zeros(self.store.n_neurons, dtype=torch.bool)
        wanted[self.store.check_ids(active_ids)] = True
        spare = cached[(self.last_active[cached] == self.steps) & ~wanted[cached]]
        self.last_active[spare] = self.steps - 1

    def _record(self, ids: torch.Tensor, staged: torch.Tensor | None) -> None:
        """Append the neurons whose bundles were just read (into `staged` host rows, when the cache is on a device;
        else into their rows already) into rows [num_used, num_used + len(ids))."""
        kept, end = self.num_used, self.num_used + ids.numel()
        if staged is not None and ids.numel():
            self.transfer.upload(staged, self.matrix[kept:end])
        self.pointer[kept:end].copy_(ids)
        self.slot_of.index_copy_(0, ids, self._row_ids[kept:end])
        if self.transfer.staged:  # a step with nothing missing has nothing to move to the device
            if ids.numel():
                self.device_pointer[kept:end].copy_(self.transfer.to_device(ids), non_blocking=True)
                if self.bias is not None:
                    self.bias[kept:end].copy_(self.transfer.to_device(self._bias_all[ids]), non_blocking=True)
        elif self.bias is not None:
            torch.index_select(self._bias_all, 0, ids, out=self.bias[kept:end])
        self.num_used = end

    def cached_ids(self) -> torch.Tensor:
        """Neuron ids of rows [0, num_used), in row order (a view)."""
        return self.pointer[: self.num_used]

    def __repr__(self) -> str:
        return (
            f"NeuronCache(layer={self.layer}, capacity={self.capacity}, pinned={self.n_pinned}, "
            f"window={self.window}, num_used={self.num_used}, nbytes={self.nbytes})"
        )


class PendingStep:
    """A NeuronCache step begun by `begin_step`: evictions done, reads of the missing bundles issued."""

    def __init__(
        self,
        cache: NeuronCache,
        evicted: int,
        evicted_budget: int,
        ids: torch.Tensor,
        read: Future | ReadResult | None,
        mem_s: float,
    ):
        self.cache, self.evicted, self.evicted_budget, self.ids = cache, evicted, evicted_budget, ids
        self._read, self._mem_s = read, mem_s

    def finish(self) -> StepStats:
        """Wait for the reads, then record the new neurons. A failed read raises here, leaving the cache holding
        what it held before minus the evictions (consistent), and the next step reads them again."""
        start = time.perf_counter()
        result = self._read.result() if isinstance(self._read, Future) else self._read
        waited = time.perf_counter() - start
        if self._read is not None and not isinstance(self._read, Future):
            waited = result.stats.wall_s  # read inline in begin_step: all of it was waited for
        self._read = None
        start = time.perf_counter()
        self.cache._record(self.ids, result.data if result is not None and self.cache.transfer.staged else None)
        mem_s = self._mem_s + self.cache.transfer.clock() - start
        read = result.stats if result is not None else None
        read_s, bytes_read = (read.wall_s, read.bytes_read) if read is not None else (0.0, 0)
        return StepStats(
            self.evicted,
            self.evicted_budget,
            self.ids.numel(),
            bytes_read,
            waited,
            mem_s,
            self.cache.num_used,
            max(0.0, read_s - waited),
            read.decompress_s if read is not None else 0.0,
            read.bytes_requested if read is not None else 0,
            read.n_reads if read is not None else 0,
        )
