"""Offloaded inference (Endor's main result): whole decoder layers placed in memory or on SSD by a DRAM budget.

    convert_offload(checkpoint, store_dir, endor=True)                 # once: a layer store, dense or Endor
    model = load_offloaded(store_dir, dram_budget="30%", mode="endor")  # a transformers model
    model.generate(...); model.offload_stats()
    runtime = patch_offload(hf_model, store_dir, mode="dense"); runtime.unpatch(hf_model)   # an already loaded model

Placement, nearest first as Endor does: layers 0..k-1 (closest to the input) stay in memory, layers k..L-1 are read
from the store for every forward, k the most layers the budget holds next to the resident tensors (embeddings,
norms, biases) and the staging buffers. An SSD layer is one contiguous, aligned range of the store's file, read
with the parallel direct-I/O FlashReader into one of two preallocated aligned buffers; while a layer computes, the
next SSD layer (cyclically: the last one's successor is the first SSD layer of the next token) is read into the
other buffer in a background thread, so reads hide behind compute where compute is long enough.

Modes, one placement code:
  dense                  dense store; in-memory layers dense, SSD layers read dense
  endor                  Endor store (pruned weights as values + bitmap, ~56% of the bytes at 50% sparsity);
                         in-memory layers decompressed once (dense, as in dense mode), SSD layers read compressed
  endor+more-resident    Endor store; in-memory layers kept compressed, so more of them fit the same budget
Endor matrices are computed with the fused `endor_linear` for decode (T <= LINEAR_MAX_TOKENS tokens: it reads the
compressed weight once, measured 1.2-2x dense F.linear and 2-3.5x decompress + F.linear, BENCHMARKS.md) and by
`endor_decompress` into one reused buffer + F.linear for prompts (a GEMM amortises the decompression).

The store (`LayerStore`): a directory with
  layers.safetensors    every decoder-layer Linear weight (attention and FFN), layer by layer (the flash store's
                        AlignedWriter): `<name>` dense, or Endor as `<name>.values/.bitmap/.row_offsets` where that
                        is smaller than dense. A layer's tensors are contiguous, its first on a 4096-byte boundary,
                        the others 64 bytes apart, so one layer is one aligned read range with little padding.
  resident.safetensors  everything else (embeddings, norms, biases, LM head), in the store dtype.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm

from . import endor, ops
from .checkpoint import Checkpoint, open_checkpoint
from .engine import _tensor_bytes, assign_resident, empty_model, parse_budget
from .errors import FormatError
from .models.hf import decoder_layers
from .reader import FlashReader
from .safetensors_io import AlignedWriter, TensorEntry, TensorSpec, dtype_name, owned_tensor, read_header
from .store import ALIGNMENT, DTYPES

MAGIC = "flashllm-offload"
FORMAT_VERSION = "1"
LAYERS_FILE = "layers.safetensors"
RESIDENT_FILE = "resident.safetensors"
END_TENSOR = "layers.end"  # zero bytes up to the next block: the last layer's range ends inside the file
TENSOR_ALIGNMENT = 64  # inside a layer: every element size and a cache line; layer starts are ALIGNMENT-aligned
MODES = ("dense", "endor", "endor+more-resident")
COMPUTES = ("auto", "linear", "decompress")
LINEAR_MAX_TOKENS = 8  # endor_linear keeps up to 8 tokens in registers; longer inputs decompress + GEMM
_LAYER_WEIGHT = re.compile(r"^(?:.*\.)?layers\.(\d+)\..+\.weight$")


def _round_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


# ------------------------------------------------------------------------------------------------ the store

@dataclass(frozen=True)
class MatrixEntry:
    """One decoder-layer Linear weight in the store: its checkpoint name, shape and form."""
    name: str
    shape: tuple[int, int]
    endor: bool

    def specs(self, dtype: torch.dtype, nnz: int) -> list[TensorSpec]:
        if not self.endor:
            return [TensorSpec(self.name, dtype_name(dtype), self.shape)]
        rows, cols = self.shape
        return [TensorSpec(f"{self.name}.values", dtype_name(dtype), (nnz,)),
                TensorSpec(f"{self.name}.bitmap", "U8", (rows, (cols + 7) // 8)),
                TensorSpec(f"{self.name}.row_offsets", "I64", (rows + 1,))]


def _layer_matrices(ckpt: Checkpoint) -> list[list[str]]:
    """Per decoder layer, in layer order, the names of its 2-D `.weight` tensors (its Linear weights)."""
    layers: dict[int, list[str]] = {}
    for name in ckpt.names:
        m = _LAYER_WEIGHT.match(name)
        if m and len(ckpt.shape(name)) == 2:
            layers.setdefault(int(m.group(1)), []).append(name)
    if not layers or sorted(layers) != list(range(len(layers))):
        raise FormatError("layers", f"no decoder-layer weights or non-contiguous layer numbers {sorted(layers)[:8]}")
    return [layers[i] for i in range(len(layers))]


def convert_offload(checkpoint: str | os.PathLike | Checkpoint, out_dir: str | os.PathLike, *, dtype: str = "fp16",
                    endor_compress: bool = False, force: bool = False, progress: bool = True) -> Path:
    """Write a layer store of `checkpoint` (a Hugging Face safetensors directory, a GGUF file, or a Checkpoint such
    as `TensorsCheckpoint(config, state_dict)`) at `out_dir`, one tensor in memory at a time. endor_compress: store
    each matrix as Endor where that is smaller than dense (pruned weights); a first pass counts the non-zeros (the
    header declares every length before any data). Atomic (written under a temporary name, then renamed); refuses
    to replace `out_dir` unless `force`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not force:
        raise FileExistsError(f"{out_dir} exists; pass force=True (--force) to replace it")
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint)
    torch_dtype = DTYPES[dtype]
    layers = _layer_matrices(ckpt)
    nnz: dict[str, int] = {}
    if endor_compress:
        for names in tqdm(layers, desc="counting non-zeros", unit="layer", disable=not progress):
            for name in names:
                nnz[name] = endor.count_nonzero(ckpt[name].to(torch_dtype))
    item = torch_dtype.itemsize
    entries = []
    for names in layers:
        layer = []
        for name in names:
            rows, cols = ckpt.shape(name)
            # Endor only where it is smaller: values + bitmap + row offsets against the dense matrix.
            compressed = name in nnz and nnz[name] * item + rows * ((cols + 7) // 8) + (rows + 1) * 8 < rows * cols * item
            layer.append(MatrixEntry(name, (rows, cols), compressed))
        entries.append(layer)
    # A layer is one read range: its first tensor starts on a block (a zero-filled `layers.{l}.align` tensor fills
    # the gap), the rest follow TENSOR_ALIGNMENT apart, so the padding costs at most a block per layer.
    specs, offset, pads = [], 0, []
    for i, layer in enumerate(entries):
        start = _round_up(offset, TENSOR_ALIGNMENT)
        gap = _round_up(start, ALIGNMENT) - start
        pads.append(TensorSpec(f"layers.{i}.align", "U8", (gap,)) if gap else None)
        specs += [pads[-1]] if gap else []
        offset = start + gap
        for spec in (s for e in layer for s in e.specs(torch_dtype, nnz.get(e.name, 0))):
            specs.append(spec)
            offset = _round_up(offset, TENSOR_ALIGNMENT) + spec.nbytes
    start = _round_up(offset, TENSOR_ALIGNMENT)
    specs.append(TensorSpec(END_TENSOR, "U8", (_round_up(start, ALIGNMENT) - start,)))
    metadata = {"magic": MAGIC, "format_version": FORMAT_VERSION, "config": json.dumps(ckpt.config),
                "dtype": dtype, "alignment": str(ALIGNMENT), "tensor_alignment": str(TENSOR_ALIGNMENT),
                "layers": json.dumps([[[e.name, list(e.shape), int(e.endor)] for e in layer] for layer in entries])}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        with AlignedWriter(tmp / LAYERS_FILE, specs, metadata, ALIGNMENT, TENSOR_ALIGNMENT) as writer:
            for pad, layer in tqdm(list(zip(pads, entries)), desc="writing layers", unit="layer",
                                   disable=not progress):
                if pad is not None:
                    writer.write(pad.name, torch.zeros(pad.shape, dtype=torch.uint8))
                for e in layer:
                    w = ckpt[e.name].to(torch_dtype)
                    if e.endor:
                        compressed = endor.compress(w)
                        for part in endor.PARTS:
                            writer.write(f"{e.name}.{part}", getattr(compressed, part))
                    else:
                        writer.write(e.name, w)
            writer.write(END_TENSOR, torch.zeros(specs[-1].shape, dtype=torch.uint8))
        in_layers = {e.name for layer in entries for e in layer}
        resident = {n: (ckpt[n].to(torch_dtype) if ckpt[n].is_floating_point() else ckpt[n]).contiguous()
                    for n in ckpt.names if n not in in_layers}
        save_file(resident, str(tmp / RESIDENT_FILE), metadata={"magic": MAGIC, "format_version": FORMAT_VERSION})
        _verify(LayerStore(tmp), ckpt, torch_dtype)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out_dir


def _verify(store: LayerStore, ckpt: Checkpoint, dtype: torch.dtype) -> None:
    """Read the first matrix of every layer back and compare it with the checkpoint's, bit for bit."""
    for layer in range(store.n_layers):
        name = store.layers[layer][0].name
        got = store.matrix(layer, name)
        got = got.decompress() if isinstance(got, endor.EndorTensor) else got
        want = ckpt[name].to(dtype)
        if not torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)):
            raise RuntimeError(f"{store.path}: read-back of {name} differs from what was written")


class LayerStore:
    """An opened, validated layer store (see the module doc). Raises FormatError naming file and field.

    layers[l]: the MatrixEntry of each Linear weight of decoder layer l; layer_range(l): (file offset, bytes) of the
    layer's one aligned read range; dense_bytes(l) / stored_bytes(l): its weights dense / as stored."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.layers_path = str(self.path / LAYERS_FILE)
        self.resident_path = str(self.path / RESIDENT_FILE)
        header = read_header(self.layers_path)
        meta = header.metadata
        resident_meta = read_header(self.resident_path).metadata
        for file, m in ((self.layers_path, meta), (self.resident_path, resident_meta)):
            if m.get("magic") != MAGIC:
                raise FormatError("__metadata__.magic", f"expected {MAGIC!r}, got {m.get('magic')!r}", file)
            if m.get("format_version") != FORMAT_VERSION:
                raise FormatError("__metadata__.format_version", f"unsupported version {m.get('format_version')!r} "
                                  f"(this library reads {FORMAT_VERSION})", file)
        if meta.get("dtype") not in DTYPES:
            raise FormatError("__metadata__.dtype", f"must be one of {sorted(DTYPES)}, got {meta.get('dtype')!r}",
                              self.layers_path)
        self.dtype = DTYPES[meta["dtype"]]
        for key, value in (("alignment", ALIGNMENT), ("tensor_alignment", TENSOR_ALIGNMENT)):
            if meta.get(key) != str(value):
                raise FormatError(f"__metadata__.{key}", f"must be {value}, got {meta.get(key)!r}", self.layers_path)
        try:
            self.config: dict = json.loads(meta.get("config", ""))
            raw_layers = json.loads(meta.get("layers", ""))
            self.layers = [[MatrixEntry(str(n), (int(s[0]), int(s[1])), bool(e)) for n, s, e in layer]
                           for layer in raw_layers]
        except (json.JSONDecodeError, TypeError, ValueError, IndexError) as e:
            raise FormatError("__metadata__.layers", f"not a list of [name, [rows, cols], endor] per layer ({e})",
                              self.layers_path) from None
        if not self.layers or not all(self.layers):
            raise FormatError("__metadata__.layers", "no layers, or a layer without weights", self.layers_path)
        self._entries = header.tensors
        self._ranges = []
        for i, layer in enumerate(self.layers):
            begin = end = None
            for e in layer:
                for spec in e.specs(self.dtype, -1):
                    t = self._entries.get(spec.name)
                    shape_ok = t is not None and (len(t.shape) == 1 if spec.shape == (-1,) else t.shape == spec.shape)
                    if not shape_ok or t.dtype != spec.dtype:
                        raise FormatError(spec.name, f"missing or not {spec.dtype}{list(spec.shape)}",
                                          self.layers_path)
                    if t.begin % TENSOR_ALIGNMENT:
                        raise FormatError(f"{spec.name}.data_offsets", f"starts at byte {t.begin}, not on a "
                                          f"{TENSOR_ALIGNMENT}-byte boundary", self.layers_path)
                    begin = t.begin if begin is None else min(begin, t.begin)
                    end = t.end if end is None else max(end, t.end)
            if begin % ALIGNMENT:
                raise FormatError(f"layers[{i}]", f"starts at byte {begin}, not on a {ALIGNMENT}-byte boundary",
                                  self.layers_path)
            self._ranges.append((begin, _round_up(end, ALIGNMENT) - begin))
        last = self._ranges[-1][0] + self._ranges[-1][1]
        if os.path.getsize(self.layers_path) < last:
            raise FormatError(END_TENSOR, f"the file ends before byte {last}, the end of the last layer's range",
                              self.layers_path)
        self._resident_file = None
        self._resident_lock = threading.Lock()

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def endor(self) -> bool:
        return any(e.endor for layer in self.layers for e in layer)

    def layer_range(self, layer: int) -> tuple[int, int]:
        return self._ranges[layer]

    def dense_bytes(self, layer: int) -> int:
        return sum(e.shape[0] * e.shape[1] for e in self.layers[layer]) * self.dtype.itemsize

    def stored_bytes(self, layer: int) -> int:
        return self._ranges[layer][1]

    def entry(self, name: str) -> TensorEntry:
        """Where tensor `name` (a dense matrix or one Endor part) lies in layers.safetensors: absolute offsets."""
        return self._entries[name]

    def matrix(self, layer: int, name: str) -> torch.Tensor | endor.EndorTensor:
        """One weight as stored (dense, or a validated EndorTensor), read with plain buffered I/O into memory of its
        own (owned_tensor)."""
        entry = next((e for e in self.layers[layer] if e.name == name), None)
        if entry is None:
            raise KeyError(f"layer {layer} of {self.path} has no matrix {name!r}")
        with safe_open(self.layers_path, framework="pt") as f:
            if not entry.endor:
                return owned_tensor(f, name)
            parts = [owned_tensor(f, f"{name}.{p}") for p in endor.PARTS]
        return endor.EndorTensor(*parts, entry.shape, source=self.layers_path)

    def resident_names(self) -> list[str]:
        return list(read_header(self.resident_path).tensors)

    def resident_tensor(self, name: str) -> torch.Tensor:
        with self._resident_lock:
            if self._resident_file is None:
                self._resident_file = safe_open(self.resident_path, framework="pt")
            return owned_tensor(self._resident_file, name)

    def __repr__(self) -> str:
        return (f"LayerStore({str(self.path)!r}, layers={self.n_layers}, dtype={self.dtype}, endor={self.endor}, "
                f"{sum(self.stored_bytes(i) for i in range(self.n_layers)) / 1e6:.1f} MB stored of "
                f"{sum(self.dense_bytes(i) for i in range(self.n_layers)) / 1e6:.1f} MB dense)")


# ---------------------------------------------------------------------------------------------- the runtime

@dataclass
class OffloadStats:
    """Accumulated costs: forwards (one per model call), bytes and reads of the consumed layer reads, read time
    exposed (waited for) and in all (the reads' wall time, hidden or not), decompression, layer compute
    (decoder-layer time minus waits and decompression)."""
    forwards: int = 0
    bytes_read: int = 0
    n_reads: int = 0
    read_wait_s: float = 0.0
    read_wall_s: float = 0.0
    decompress_s: float = 0.0
    compute_s: float = 0.0

    def reset(self) -> None:
        for name, value in OffloadStats().__dict__.items():
            setattr(self, name, value)


class OffloadedLinear(nn.Module):
    """A decoder layer's Linear whose weight the runtime provides per forward: dense or Endor, in memory or in a
    staging buffer. The bias (if any) stays a parameter here."""

    def __init__(self, runtime: OffloadRuntime, layer: int, name: str, shape: tuple[int, int],
                 bias: nn.Parameter | None):
        super().__init__()
        self.runtime, self.layer, self.name = runtime, layer, name
        self.out_features, self.in_features = shape
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.runtime.linear(x, self.runtime.weight(self.layer, self.name), self.bias)

    def extra_repr(self) -> str:
        where = "memory" if self.layer < self.runtime.layers_in_memory else "ssd"
        return f"in_features={self.in_features}, out_features={self.out_features}, layer={self.layer}, {where}"


@dataclass
class _Pending:
    layer: int
    slot: int
    future: Future


@dataclass
class OffloadRuntime:
    """What offloading installed in a model: placement, budget split, buffers, reader and stats."""
    store: LayerStore
    mode: str
    compute: str
    budget_bytes: int | None
    resident_bytes: int  # the model's tensors outside the decoder-layer Linear weights
    layers_in_memory: int
    memory_bytes: int  # the in-memory layers' weights (dense, or compressed in endor+more-resident)
    staging_bytes: int  # two read buffers + the decompression buffer
    threads: int
    stats: OffloadStats = field(default_factory=OffloadStats)
    memory: list[dict[str, torch.Tensor | endor.EndorTensor]] = field(default_factory=list)
    originals: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)
    hooks: list = field(default_factory=list)
    reader: FlashReader | None = None

    def __post_init__(self):
        n = self.store.n_layers
        self.ssd_layers = list(range(self.layers_in_memory, n))
        spans = [self.store.stored_bytes(i) for i in self.ssd_layers]
        self._slots = [_aligned_buffer(max(spans)) for _ in range(2)] if spans else []
        self._ids = torch.arange(max(spans, default=0) // ALIGNMENT, dtype=torch.int64)
        self._views: dict[tuple[int, int], dict] = {}
        self._slot_of: dict[int, int] = {}
        self._pending: _Pending | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashllm-offload") if spans else None
        self._layer_start = self._decompress_at_start = 0.0
        endor_sizes = [e.shape[0] * e.shape[1] for i in range(n) for e in self.store.layers[i] if e.endor and
                       (i >= self.layers_in_memory or self.mode == "endor+more-resident")]
        self._decompress = torch.empty(max(endor_sizes, default=0), dtype=self.store.dtype)

    @property
    def accounted_bytes(self) -> int:
        return self.resident_bytes + self.memory_bytes + self.staging_bytes

    @property
    def layers_on_ssd(self) -> int:
        return len(self.ssd_layers)

    # -- per forward
    def weight(self, layer: int, name: str) -> torch.Tensor | endor.EndorTensor:
        if layer < self.layers_in_memory:
            return self.memory[layer][name]
        slot = self._slot_of[layer]
        views = self._views.get((slot, layer))
        if views is None:
            views = self._views[(slot, layer)] = self._layer_views(slot, layer)
        return views[name]

    def linear(self, x: torch.Tensor, w: torch.Tensor | endor.EndorTensor, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(w, torch.Tensor):
            return F.linear(x, w, bias)
        rows, cols = w.shape
        flat = x.reshape(-1, cols)
        bias = None if bias is None else bias.detach()
        if self.compute == "linear" or (self.compute == "auto" and flat.shape[0] <= LINEAR_MAX_TOKENS):
            y = ops.endor_linear(flat, w.values, w.bitmap, w.row_offsets, n_cols=cols, bias=bias)
        else:
            start = time.perf_counter()
            dense = ops.endor_decompress(w.values, w.bitmap, w.row_offsets, n_cols=cols,
                                         out=self._decompress[:rows * cols].view(rows, cols))
            self.stats.decompress_s += time.perf_counter() - start
            y = F.linear(flat, dense, bias)
        return y.reshape(*x.shape[:-1], rows)

    def before_layer(self, layer: int) -> None:
        if layer == 0:
            self.stats.forwards += 1
        if layer >= self.layers_in_memory:
            self._ensure(layer)
        self._layer_start = time.perf_counter()
        self._decompress_at_start = self.stats.decompress_s

    def after_layer(self, layer: int) -> None:
        spent = time.perf_counter() - self._layer_start
        self.stats.compute_s += spent - (self.stats.decompress_s - self._decompress_at_start)

    def _ensure(self, layer: int) -> None:
        """Make `layer`'s weights present in a slot, then start reading the next SSD layer into the other one."""
        pending, self._pending = self._pending, None
        slot = 0
        if pending is not None:
            start = time.perf_counter()
            try:
                stats = pending.future.result()
            except Exception as e:
                if pending.layer == layer:
                    raise RuntimeError(f"offload: reading layer {layer} from {self.store.layers_path} failed: "
                                       f"{e}") from e
                stats = None  # a read nobody needs any more (an earlier forward stopped early): its error too
            wait = time.perf_counter() - start
            if pending.layer == layer:
                self.stats.read_wait_s += wait
                self._account(stats)
                slot = pending.slot
            else:
                slot = 1 - pending.slot
        if pending is None or pending.layer != layer:
            start = time.perf_counter()
            try:
                stats = self._read(layer, slot)
            except Exception as e:
                raise RuntimeError(f"offload: reading layer {layer} from {self.store.layers_path} failed: "
                                   f"{e}") from e
            self.stats.read_wait_s += time.perf_counter() - start
            self._account(stats)
        self._slot_of[layer] = slot
        position = self.ssd_layers.index(layer)
        following = self.ssd_layers[(position + 1) % len(self.ssd_layers)]
        self._pending = _Pending(following, 1 - slot, self._executor.submit(self._read, following, 1 - slot))

    def _read(self, layer: int, slot: int):
        offset, size = self.store.layer_range(layer)
        return self.reader.read_rows(offset, ALIGNMENT, size // ALIGNMENT, self._ids[:size // ALIGNMENT],
                                     self._slots[slot][:size])

    def _account(self, stats) -> None:
        self.stats.bytes_read += stats.bytes_read
        self.stats.n_reads += stats.n_reads
        self.stats.read_wall_s += stats.wall_s

    def _layer_views(self, slot: int, layer: int) -> dict:
        """Tensors over the slot's bytes for each weight of `layer` (dense, or an unvalidated EndorTensor: the
        kernels check every row they read)."""
        buffer, base = self._slots[slot], self.store.layer_range(layer)[0]

        def part(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
            entry = self.store.entry(name)
            return buffer[entry.begin - base:entry.end - base].view(dtype).view(shape)

        views = {}
        for e in self.store.layers[layer]:
            if e.endor:
                rows, cols = e.shape
                values = self.store.entry(f"{e.name}.values")
                views[e.name] = endor.EndorTensor(
                    part(f"{e.name}.values", self.store.dtype, values.shape),
                    part(f"{e.name}.bitmap", torch.uint8, (rows, (cols + 7) // 8)),
                    part(f"{e.name}.row_offsets", torch.int64, (rows + 1,)), e.shape, validate=False)
            else:
                views[e.name] = part(e.name, self.store.dtype, e.shape)
        return views

    # -- reporting and teardown
    def offload_stats(self) -> dict:
        """Per forward (a decode step = one token): read (exposed) / read wall / decompress / compute ms, bytes and
        reads, plus the placement and the accounted bytes."""
        s = self.stats
        per = 1e3 / max(s.forwards, 1)
        return {"mode": self.mode, "compute": self.compute, "forwards": s.forwards, "read_ms": s.read_wait_s * per,
                "read_wall_ms": s.read_wall_s * per, "decompress_ms": s.decompress_s * per,
                "compute_ms": s.compute_s * per, "bytes_read_per_token": s.bytes_read / max(s.forwards, 1),
                "reads_per_token": s.n_reads / max(s.forwards, 1), "layers_in_memory": self.layers_in_memory,
                "layers_on_ssd": self.layers_on_ssd, "budget_bytes": self.budget_bytes,
                "accounted_bytes": self.accounted_bytes, "resident_bytes": self.resident_bytes,
                "memory_layer_bytes": self.memory_bytes, "staging_bytes": self.staging_bytes}

    def close(self) -> None:
        """Waits for the background read, then releases the reader and its threads."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._pending = None
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    def unpatch(self, model: nn.Module) -> None:
        """Put the original Linear modules back (patch_offload only), remove the hooks, release the reader."""
        if not self.originals:
            raise RuntimeError("this model was built by load_offloaded: it has no original layers to restore")
        self.close()
        for hook in self.hooks:
            hook.remove()
        for parent, attr, module in self.originals:
            setattr(parent, attr, module)
        for attr in ("offload", "offload_stats"):
            model.__dict__.pop(attr, None)


def _drop_page_cache(path: str) -> None:
    """Drop the clean cached pages of `path` (posix_fadvise DONTNEED): loading the in-memory layers read them
    through the page cache, and a memory cgroup charges them to the process until it reclaims them; left there,
    they held an Endor child at its limit with its layer reads at half speed (BENCHMARKS.md, seventh-session scale
    run)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _aligned_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] starting on an ALIGNMENT boundary, so direct reads land in it without a bounce copy."""
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGNMENT
    return raw[skip:skip + nbytes]


# ------------------------------------------------------------------------------------------ placement, install

def plan_placement(store: LayerStore, mode: str, layer_budget: int | None,
                   layers_in_memory: int | None = None) -> tuple[int, int, int]:
    """(layers in memory k, their bytes, staging bytes): the largest k, nearest first, with the first k layers'
    in-memory bytes + the staging for layers k.. within `layer_budget` (None: every layer in memory); or k =
    `layers_in_memory` when given (a placement to compare modes on), if it fits. Raises ValueError when it does not
    fit (_BudgetTooSmall when not even k = 0 does)."""
    n = store.n_layers
    keep_compressed = mode == "endor+more-resident"
    cost = [store.stored_bytes(i) if keep_compressed else store.dense_bytes(i) for i in range(n)]
    item = store.dtype.itemsize

    def staging(k: int) -> int:
        if k == n:
            return 0
        decompress = max((e.shape[0] * e.shape[1] * item for i in range(n) for e in store.layers[i] if e.endor and
                          (i >= k or keep_compressed)), default=0)
        return 2 * max(store.stored_bytes(i) for i in range(k, n)) + decompress

    def total(k: int) -> int:
        return sum(cost[:k]) + staging(k)

    if layers_in_memory is not None:
        k = layers_in_memory
        if not 0 <= k <= n:
            raise ValueError(f"layers_in_memory must lie in [0, {n}], got {k}")
        if layer_budget is not None and total(k) > layer_budget:
            raise ValueError(f"{k} layers in memory in {mode} mode need {total(k)} bytes for the layers and staging, "
                             f"{layer_budget} are left of the budget")
        return k, sum(cost[:k]), staging(k)
    if layer_budget is None:
        return n, sum(cost), 0
    if total(0) > layer_budget:
        raise _BudgetTooSmall(total(0))
    k = max(k for k in range(n + 1) if total(k) <= layer_budget)
    return k, sum(cost[:k]), staging(k)


class _BudgetTooSmall(ValueError):
    def __init__(self, need: int):
        super().__init__(need)
        self.need = need


def _linear_slots(model: nn.Module, store: LayerStore) -> list[list[tuple[nn.Module, str, nn.Linear, str]]]:
    """Per decoder layer: (parent module, attribute, the Linear, its weight's checkpoint name), matched one to one
    with the store's matrices of that layer."""
    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: not a Llama-family or OPT causal LM (no decoder layers found)")
    if len(layers) != store.n_layers:
        raise ValueError(f"{type(model).__name__} has {len(layers)} decoder layers, the store {store.path} has "
                         f"{store.n_layers}")
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for i, layer in enumerate(layers):
        prefix = names[id(layer)]
        slots = []
        for sub, module in layer.named_modules():
            if isinstance(module, (nn.Linear, OffloadedLinear)):
                parent_name, _, attr = sub.rpartition(".")
                slots.append((layer.get_submodule(parent_name) if parent_name else layer, attr, module,
                              f"{prefix}.{sub}.weight"))
        want = {e.name: e.shape for e in store.layers[i]}
        have = {s[3]: (s[2].out_features, s[2].in_features) for s in slots}
        if want != have:
            raise ValueError(f"layer {i}: the model's Linear weights {sorted(have.items())[:4]} differ from the "
                             f"store's {sorted(want.items())[:4]} ({store.path}): not the same model")
        out.append(slots)
    return out


def _install(model: nn.Module, store: LayerStore, mode: str, budget: int | float | str | None, compute: str,
             threads: int, keep_originals: bool, layers_in_memory: int | None = None) -> OffloadRuntime:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if compute not in COMPUTES:
        raise ValueError(f"compute must be one of {COMPUTES}, got {compute!r}")
    if (mode != "dense") != store.endor:
        raise ValueError(f"{mode} mode needs {'an Endor' if mode != 'dense' else 'a dense'} layer store; {store.path} "
                         f"is {'Endor' if store.endor else 'dense'} (convert_offload endor_compress=)")
    if getattr(model, "offload", None) is not None:
        raise ValueError("this model is already offloaded: unpatch it first")
    slots = _linear_slots(model, store)
    params = [p for p in model.parameters() if p.device.type != "meta" and p.is_floating_point()]
    if params and params[0].dtype != store.dtype:
        raise ValueError(f"the model is {params[0].dtype}, the store {store.path} {store.dtype}: load the model in "
                         f"the store's dtype")
    weights = {id(s[2].weight) for layer in slots for s in layer if isinstance(s[2], nn.Linear)}
    resident = _tensor_bytes([p for p in model.parameters() if id(p) not in weights] + list(model.buffers()))
    budget_bytes = None if budget is None else parse_budget(budget, resident + sum(
        store.dense_bytes(i) for i in range(store.n_layers)))
    try:
        k, memory_bytes, staging = plan_placement(store, mode, None if budget_bytes is None else
                                                  budget_bytes - resident, layers_in_memory)
    except _BudgetTooSmall as e:
        raise ValueError(f"dram_budget of {budget_bytes} bytes is below the minimum of {resident + e.need} for "
                         f"{mode} offload ({resident} resident tensors + {e.need} for two staging buffers of the "
                         f"largest layer and the decompression buffer)") from None
    runtime = OffloadRuntime(store, mode, compute, budget_bytes, resident, k, memory_bytes, staging, threads)
    for i in range(k):  # in memory: dense (dense, endor), or as stored (endor+more-resident)
        layer = {}
        for e in store.layers[i]:
            w = store.matrix(i, e.name)
            layer[e.name] = w.decompress() if isinstance(w, endor.EndorTensor) and mode != "endor+more-resident" else w
        runtime.memory.append(layer)
    if k:
        _drop_page_cache(store.layers_path)
    if runtime.ssd_layers:
        runtime.reader = FlashReader.for_file(store.layers_path, threads=threads)
    for i, layer_slots in enumerate(slots):
        for parent, attr, linear, name in layer_slots:
            if keep_originals:
                runtime.originals.append((parent, attr, linear))
            entry = next(e for e in store.layers[i] if e.name == name)
            setattr(parent, attr, OffloadedLinear(runtime, i, name, entry.shape, linear.bias))
    for i, layer in enumerate(decoder_layers(model)):
        runtime.hooks.append(layer.register_forward_pre_hook(lambda _m, _a, i=i: runtime.before_layer(i)))
        runtime.hooks.append(layer.register_forward_hook(lambda _m, _a, _o, i=i: runtime.after_layer(i)))
    model.offload = runtime
    model.offload_stats = runtime.offload_stats
    return runtime


def patch_offload(model: nn.Module, store: LayerStore | str | os.PathLike, *, mode: str = "endor",
                  dram_budget: int | float | str | None = None, compute: str = "auto",
                  threads: int = 32) -> OffloadRuntime:
    """Offload the decoder layers of an already loaded Llama-family or OPT model (in the store's dtype) to `store`
    (converted from the same weights). The original Linear modules are kept for `unpatch`, so they still occupy
    memory: for a real budget use load_offloaded. Returns the runtime; `runtime.unpatch(model)` restores the
    model."""
    store = store if isinstance(store, LayerStore) else LayerStore(store)
    return _install(model, store, mode, dram_budget, compute, threads, keep_originals=True)


def load_offloaded(store_dir: str | os.PathLike, dram_budget: int | float | str | None = "30%", *,
                   mode: str = "endor", compute: str = "auto", threads: int = 32,
                   layers_in_memory: int | None = None) -> nn.Module:
    """A Hugging Face causal LM built from a layer store, its decoder layers in memory or on SSD by `dram_budget`
    (bytes, "30%" of the dense model, or "2GB"; None: no limit): the most layers that fit, or `layers_in_memory`
    (e.g. another mode's placement, to compare on the same one; ValueError if it does not fit). Only the resident
    tensors and the in-memory layers are materialised, in the store's dtype. `model.offload_stats()` reports
    per-token costs."""
    store = LayerStore(store_dir)
    model = empty_model(store.config, store.dtype, store.path)
    assign_resident(model, store, store.dtype)
    _install(model, store, mode, dram_budget, compute, threads, keep_originals=False,
             layers_in_memory=layers_in_memory)
    leftover = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if leftover:
        raise ValueError(f"{store.path}: the store has no tensor for {leftover[:3]} ({len(leftover)} in all)")
    return model.eval()
