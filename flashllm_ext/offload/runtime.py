"""OffloadRuntime: what offloading installs in a model: slots, background fetches, per-forward weights, stats."""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from flashllm_ext import endor, ops
from flashllm_ext.flash.reader import FlashReader, ReadStats, select_read_path
from flashllm_ext.io.buffers import ALIGNMENT, aligned_buffer
from flashllm_ext.offload.placement import Placement, decompress_block_rows
from flashllm_ext.ops.blocks import QuantizedWeight
from flashllm_ext.offload.store import LayerStore
from flashllm_ext.runtime import Runtime, deprecated_alias


LINEAR_MAX_TOKENS = 8  # endor_linear keeps up to 8 tokens in registers; longer inputs decompress + GEMM
# On an H100 the CUDA endor_linear beats decompress + GEMM at T = 1 (1.14-1.57x) and loses at T = 4 (0.72-0.81x)
# (BENCHMARKS.md, "Endor decompression and `endor_linear`"; an H200 since: 1.08-1.23x at T = 1)
CUDA_LINEAR_MAX_TOKENS = 1


# ---------------------------------------------------------------------------------------------- the runtime


@dataclass
class OffloadStats:
    """Accumulated costs: forwards (one per model call), bytes and reads of the consumed layer reads, bytes moved
    from host memory to the device, read time exposed (waited for) and in all (the fetches' wall time, hidden or
    not), decompression, layer compute (decoder-layer time minus waits and decompression)."""

    forwards: int = 0
    bytes_read: int = 0
    n_reads: int = 0
    bytes_moved: int = 0
    read_wait_s: float = 0.0
    read_wall_s: float = 0.0
    decompress_s: float = 0.0
    compute_s: float = 0.0

    def reset(self) -> None:
        for name, value in OffloadStats().__dict__.items():
            setattr(self, name, value)


class OffloadedLinear(nn.Module):
    """A decoder layer's Linear whose weight the runtime provides per forward: dense, Endor or quantized (blocks),
    resident or in a slot. The bias (if any) stays a parameter here."""

    def __init__(
        self, runtime: OffloadRuntime, layer: int, name: str, shape: tuple[int, int], bias: nn.Parameter | None
    ):
        super().__init__()
        self.runtime, self.layer, self.name = runtime, layer, name
        self.out_features, self.in_features = shape
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.runtime.linear(x, self.runtime.weight(self.layer, self.name), self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, layer={self.layer}, "
            f"{self.runtime.placement.tier(self.layer)}"
        )


@dataclass
class _Pending:
    layer: int
    slot: int
    future: Future


@dataclass(frozen=True)
class _Fetched:
    """What bringing one layer into a slot did: store bytes read and reads, host bytes moved, wall seconds."""

    bytes_read: int
    n_reads: int
    bytes_moved: int
    wall_s: float


@dataclass
class OffloadRuntime(Runtime):
    """What offloading installed in a model: placement, budgets, buffers, reader and stats."""

    store: LayerStore
    mode: str
    compute: str
    device: torch.device
    budget_bytes: int | None  # host memory
    device_budget_bytes: int | None  # GPU memory (CUDA only; on the CPU the budget is one pool)
    resident_bytes: int  # the model's tensors outside the decoder-layer Linear weights (on the device)
    placement: Placement
    threads: int
    counters: OffloadStats = field(default_factory=OffloadStats)
    memory: list[dict[str, torch.Tensor | endor.EndorTensor]] = field(default_factory=list)  # on-device layers
    host_layers: list[torch.Tensor] = field(default_factory=list)  # in-memory layers' stored bytes (staged tier)
    originals: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)
    hooks: list = field(default_factory=list)
    reader: FlashReader | None = None

    def __post_init__(self):
        p, self._cuda = self.placement, self.device.type == "cuda"
        self.moved_layers = list(range(p.on_device, p.n_layers))
        spans = [self.store.stored_bytes(i) for i in self.moved_layers]
        self._slots = [self._slot_buffer(max(spans)) for _ in range(p.slots)] if spans else []
        self._ids = torch.arange(max(spans, default=0) // ALIGNMENT, dtype=torch.int64)
        self._views: dict[tuple[int, int], dict] = {}
        self._slot_of: dict[int, int] = {}
        self._pending: _Pending | None = None
        # On CUDA: the event after the last compute that used each slot (a fetch into the slot waits for it), and
        # the stream fetches copy on, so a fetch overlaps the compute of the layer before it.
        self._slot_free: list[torch.cuda.Event | None] = [None] * p.slots
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda and spans else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashllm-offload") if spans else None
        self._closed = False
        self._layer_start = self._decompress_at_start = 0.0
        self._decompress = torch.empty(
            p.decompress_bytes // self.store.dtype.itemsize, dtype=self.store.dtype, device=self.device
        )
        self._row_ids = torch.arange(
            max((e.shape[0] for layer in self.store.layers for e in layer if e.endor), default=0), device=self.device
        )

    def _slot_buffer(self, nbytes: int) -> torch.Tensor:
        if self._cuda:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return aligned_buffer(nbytes)

    @property
    def layers_in_memory(self) -> int:
        return self.placement.in_memory

    @property
    def layers_on_device(self) -> int:
        return self.placement.on_device

    @property
    def layers_on_ssd(self) -> int:
        return self.placement.n_layers - self.placement.in_memory

    @property
    def accounted_bytes(self) -> int:
        """Host memory charged to the budget: everything on the CPU; the staged tier and bounce buffer on CUDA."""
        if self._cuda:
            return self.placement.host_bytes
        return self.resident_bytes + self.placement.host_bytes + self.placement.device_bytes

    @property
    def device_accounted_bytes(self) -> int | None:
        """GPU memory charged to the device budget (None on the CPU): resident tensors, on-device layers, slots."""
        return self.resident_bytes + self.placement.device_bytes if self._cuda else None

    # -- per forward
    def weight(self, layer: int, name: str) -> torch.Tensor | endor.EndorTensor | QuantizedWeight:
        if layer < self.layers_on_device:
            return self.memory[layer][name]
        slot = self._slot_of[layer]
        views = self._views.get((slot, layer))
        if views is None:
            views = self._views[(slot, layer)] = self._layer_views(slot, layer)
        return views[name]

    def slot_of(self, layer: int) -> int | None:
        """The slot a moved layer was last put in (its weights are there during its forward); None for the others."""
        return self._slot_of.get(layer)

    def linear(
        self, x: torch.Tensor, w: torch.Tensor | endor.EndorTensor | QuantizedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if isinstance(w, torch.Tensor):
            return F.linear(x, w, bias)
        bias = None if bias is None else bias.detach()
        if isinstance(w, QuantizedWeight):
            return ops.quantized_matmul(x, w, bias)
        rows, cols = w.shape
        flat = x.reshape(-1, cols)
        max_tokens = CUDA_LINEAR_MAX_TOKENS if self._cuda else LINEAR_MAX_TOKENS
        if self.compute == "linear" or (self.compute == "auto" and flat.shape[0] <= max_tokens):
            bias = None if bias is None else bias.to(x.dtype)  # endor_linear takes x in float32 too
            y = ops.endor_linear(flat, w.values, w.bitmap, w.row_offsets, n_cols=cols, bias=bias)
        else:
            # the GEMM in the store's dtype (a lean decoder's activations are float32)
            flat = flat.to(self.store.dtype)
            bias = None if bias is None else bias.to(self.store.dtype)
            block = decompress_block_rows(rows, cols, self.store.dtype.itemsize)
            parts = []
            for first in range(0, rows, block):
                n = min(block, rows - first)
                start = self._clock()
                dense = ops.endor_decompress(
                    w.values,
                    w.bitmap,
                    w.row_offsets,
                    n_cols=cols,
                    rows=None if n == rows else self._row_ids[first : first + n],
                    out=self._decompress[: n * cols].view(n, cols),
                )
                self.counters.decompress_s += self._clock() - start
                parts.append(F.linear(flat, dense, None if bias is None else bias[first : first + n]))
            y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return y.reshape(*x.shape[:-1], rows).to(x.dtype)

    def _clock(self) -> float:
        """time.perf_counter() once the device's queued work has run (CUDA), so the parts get device time."""
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()

    def before_layer(self, layer: int) -> None:
        if self._closed:
            raise RuntimeError("offload: this runtime is closed (close() or unpatch()): load the model again to run it")
        if layer == 0:
            self.counters.forwards += 1
        if layer >= self.layers_on_device:
            self._ensure(layer)
        self._layer_start = self._clock()
        self._decompress_at_start = self.counters.decompress_s

    def after_layer(self, layer: int) -> None:
        moved = layer >= self.layers_on_device
        if self._cuda and moved:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._slot_free[self._slot_of[layer]] = event
        if moved and len(self._slots) == 1:  # the slot is free once this layer's compute is: the next fetch starts
            self._prefetch_after(layer, 0)
        spent = self._clock() - self._layer_start
        self.counters.compute_s += spent - (self.counters.decompress_s - self._decompress_at_start)

    def _ensure(self, layer: int) -> None:
        """Make `layer`'s weights present in a slot; with two slots, start fetching the next moved layer into the
        other one (with one, after_layer starts it once this layer is done with the slot)."""
        pending, self._pending = self._pending, None
        slot = 0
        if pending is not None:
            start = time.perf_counter()
            try:
                fetched = pending.future.result()
            except Exception as e:
                if pending.layer == layer:
                    raise RuntimeError(
                        f"offload: reading layer {layer} from {self.store.layers_path} failed: {e}"
                    ) from e
                fetched = None  # a fetch nobody needs any more (an earlier forward stopped early): its error too
            wait = time.perf_counter() - start
            slot = pending.slot  # written by the fetch, done now: this layer goes there either way
            if pending.layer == layer:
                self.counters.read_wait_s += wait
                self._account(fetched)
        if pending is None or pending.layer != layer:
            start = time.perf_counter()
            try:
                fetched = self._fetch(layer, slot, self._slot_free[slot])
            except Exception as e:
                raise RuntimeError(f"offload: reading layer {layer} from {self.store.layers_path} failed: {e}") from e
            self.counters.read_wait_s += time.perf_counter() - start
            self._account(fetched)
        self._slot_of[layer] = slot
        if len(self._slots) == 2:
            self._prefetch_after(layer, 1 - slot)

    def _prefetch_after(self, layer: int, slot: int) -> None:
        """Start fetching the moved layer after `layer` (cyclically: the last one's successor is the first moved
        layer of the next forward) into `slot`, in the background thread, after the compute that last used it."""
        position = self.moved_layers.index(layer)
        following = self.moved_layers[(position + 1) % len(self.moved_layers)]
        self._pending = _Pending(
            following, slot, self._executor.submit(self._fetch, following, slot, self._slot_free[slot])
        )

    def _fetch(self, layer: int, slot: int, slot_free: torch.cuda.Event | None) -> _Fetched:
        """Bring `layer`'s stored bytes into `slot`: a copy from host memory (the staged tier) or a read of the
        store. On CUDA it first waits for the compute that last used the slot (`slot_free`), copies on the copy
        stream, and returns once the bytes are in place."""
        start = time.perf_counter()
        size = self.store.layer_range(layer)[1]
        target = self._slots[slot][:size]
        if slot_free is not None:
            slot_free.synchronize()
        with torch.cuda.stream(self._copy_stream) if self._cuda else contextlib.nullcontext():
            if layer < self.layers_in_memory:
                target.copy_(self.host_layers[layer - self.layers_on_device], non_blocking=True)
                read, n_reads, moved = 0, 0, size
            else:
                stats = self.read_layer(layer, target)
                read, n_reads, moved = stats.bytes_read, stats.n_reads, size if stats.path == "pinned" else 0
            if self._cuda:
                self._copy_stream.synchronize()
        return _Fetched(read, n_reads, moved, time.perf_counter() - start)

    def read_layer(self, layer: int, out: torch.Tensor) -> ReadStats:
        """The stored bytes of moved layer `layer` (its whole read range) into `out` (uint8, that many bytes, host or
        device), with the parallel direct-I/O reader."""
        offset, size = self.store.layer_range(layer)
        return self.reader.read_rows(offset, ALIGNMENT, size // ALIGNMENT, self._ids[: size // ALIGNMENT], out)

    def _account(self, fetched: _Fetched) -> None:
        self.counters.bytes_read += fetched.bytes_read
        self.counters.n_reads += fetched.n_reads
        self.counters.bytes_moved += fetched.bytes_moved
        self.counters.read_wall_s += fetched.wall_s

    def _layer_views(self, slot: int, layer: int) -> dict:
        """Tensors over the slot's bytes for each weight of `layer` (dense, a QuantizedWeight, or an unvalidated
        EndorTensor: the kernels check every row they read)."""
        buffer, base = self._slots[slot], self.store.layer_range(layer)[0]

        def part(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
            entry = self.store.entry(name)
            return buffer[entry.begin - base : entry.end - base].view(dtype).view(shape)

        views = {}
        for e in self.store.layers[layer]:
            if e.endor:
                rows, cols = e.shape
                values = self.store.entry(f"{e.name}.values")
                views[e.name] = endor.EndorTensor(
                    part(f"{e.name}.values", self.store.dtype, values.shape),
                    part(f"{e.name}.bitmap", torch.uint8, (rows, (cols + 7) // 8)),
                    part(f"{e.name}.row_offsets", torch.int64, (rows + 1,)),
                    e.shape,
                    validate=False,
                )
            elif e.block_format:
                blocks = self.store.entry(e.name)
                views[e.name] = QuantizedWeight(part(e.name, torch.uint8, blocks.shape), e.block_format, e.shape[1])
            else:
                views[e.name] = part(e.name, self.store.dtype, e.shape)
        return views

    # -- reporting and teardown
    attribute = "offload"
    built_by = "load_offload"

    def stats(self) -> dict:
        """Per forward (a decode step = one token): read (exposed) / read wall / decompress / compute ms, bytes read
        and reads, bytes moved from host memory to the device, plus the placement and the accounted bytes."""
        s, p = self.counters, self.placement
        per = 1e3 / max(s.forwards, 1)
        tokens = max(s.forwards, 1)
        return {
            "mode": self.mode,
            "compute": self.compute,
            "device": str(self.device),
            "forwards": s.forwards,
            "read_path": self.read_path,
            "read_ms": s.read_wait_s * per,
            "read_wall_ms": s.read_wall_s * per,
            "decompress_ms": s.decompress_s * per,
            "compute_ms": s.compute_s * per,
            "bytes_read_per_token": s.bytes_read / tokens,
            "reads_per_token": s.n_reads / tokens,
            "bytes_moved_per_token": s.bytes_moved / tokens,
            "layers_on_device": p.on_device,
            "layers_in_memory": p.in_memory,
            "layers_on_ssd": self.layers_on_ssd,
            "budget_bytes": self.budget_bytes,
            "accounted_bytes": self.accounted_bytes,
            "device_budget_bytes": self.device_budget_bytes,
            "device_accounted_bytes": self.device_accounted_bytes,
            "resident_bytes": self.resident_bytes,
            "memory_layer_bytes": p.device_layer_bytes + p.host_layer_bytes,
            "staging_bytes": p.slot_bytes + p.decompress_bytes + p.bounce_bytes,
            "slots": p.slots,
        }

    offload_stats = deprecated_alias(stats, "OffloadRuntime.offload_stats()", "OffloadRuntime.stats()")

    @property
    def read_path(self) -> str | None:
        """How SSD layers reach the device (reader.READ_PATHS), None when every layer is in memory."""
        return select_read_path(self.device) if self.layers_on_ssd else None

    def close(self) -> None:
        """Waits for the background fetch, then releases the reader and its threads. A closed runtime runs nothing."""
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._pending = None
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    def _restore_originals(self) -> None:
        for parent, attr, module in self.originals:
            setattr(parent, attr, module)
