"""Offloaded inference (Endor's main result): whole decoder layers placed in memory or on SSD by a DRAM budget.

    convert_offload(checkpoint, store_dir, endor=True)                 # once: a layer store, dense or Endor
    model = load_offloaded(store_dir, dram_budget="30%", mode="endor")  # a transformers model
    model = load_offloaded(store_dir, "30%", device="cuda", device_budget="20%")  # GPU, host memory, SSD
    model.generate(...); model.offload_stats()
    runtime = patch_offload(hf_model, store_dir, mode="dense"); runtime.unpatch(hf_model)   # an already loaded model

Placement, nearest first as Endor does: layers 0..k-1 (closest to the input) stay in memory, layers k..L-1 are read
from the store for every forward, k the most layers the budget holds next to the resident tensors (embeddings,
norms, biases) and the staging buffers. An SSD layer is one contiguous, aligned range of the store's file, read
with the parallel direct-I/O FlashReader into one of two preallocated slots; while a layer computes, the next
moved layer (cyclically: the last one's successor is the first moved layer of the next token) is fetched into the
other slot in a background thread, so reads hide behind compute where compute is long enough. With slots=1 the
next fetch starts once the layer's compute is done with the one slot: nothing hides, and the second slot's memory
holds one more layer (a GPU computes a decode layer in milliseconds, beside a fetch of tens to hundreds).

On a GPU (device="cuda") there are three tiers, as in Endor: the resident tensors and the first layers in GPU
memory (device_budget), the next layers in pinned host memory as stored (dram_budget; compressed in the Endor
modes), copied into a GPU slot for each use, the rest read from SSD straight into a GPU slot (kvikio, GPUDirect
Storage where the machine has it) or through a pinned buffer. Endor layers are decompressed on the GPU, so only
compressed bytes cross PCIe. A fetch waits (in the background thread) for the compute that last used its slot, so
the host never waits on the device for it. On the CPU the same three-tier path runs when asked for
(layers_on_device < layers_in_memory: Placement): the test double of the GPU's.

Modes, one placement code:
  dense                  dense store; in-memory layers dense, SSD layers read dense
  endor                  Endor store (pruned weights as values + bitmap, ~56% of the bytes at 50% sparsity);
                         in-memory layers decompressed once (dense, as in dense mode), SSD layers read compressed
  endor+more-resident    Endor store; in-memory layers kept compressed, so more of them fit the same budget
Endor matrices are computed with the fused `endor_linear` for decode (T <= LINEAR_MAX_TOKENS tokens: it reads the
compressed weight once, measured 1.2-2x dense F.linear and 2-3.5x decompress + F.linear, BENCHMARKS.md) and by
`endor_decompress` + F.linear for prompts (a GEMM amortises the decompression), DECOMPRESS_BLOCK_BYTES of rows at a
time into one reused buffer.

The store (`LayerStore`): a directory with
  layers.safetensors    every decoder-layer Linear weight (attention and FFN), layer by layer (the flash store's
                        AlignedWriter): `<name>` dense, or Endor as `<name>.values/.bitmap/.row_offsets` where that
                        is smaller than dense. A layer's tensors are contiguous, its first on a 4096-byte boundary,
                        the others 64 bytes apart, so one layer is one aligned read range with little padding.
  resident.safetensors  everything else (embeddings, norms, biases, LM head), in the store dtype.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from . import endor, ops
from .checkpoint import Checkpoint, open_checkpoint, unsupported_model
from .engine import _tensor_bytes, assign_resident, empty_model, parse_budget
from .errors import FormatError
from .models.hf import decoder_layers
from .paths import check_out_dir, install_dir, staging_dir
from .reader import MAX_THREADS, FlashReader, ReadStats, host_bounce_bytes, select_read_path
from .safetensors_io import (AlignedWriter, ResidentFile, TensorEntry, TensorSpec, drop_page_cache, dtype_name,
                             owned_tensor, read_header, save_tensors)
from .store import ALIGNMENT, BUNDLES_FILE, DTYPES, parse_model_config
from .transfer import aligned_buffer, cuda_device, pinned_buffer

MAGIC = "flashllm-offload"
FORMAT_VERSION = "1"
LAYERS_FILE = "layers.safetensors"
RESIDENT_FILE = "resident.safetensors"
STORE_FILES = (LAYERS_FILE, RESIDENT_FILE)  # what convert_offload writes: --force replaces these only
END_TENSOR = "layers.end"  # zero bytes up to the next block: the last layer's range ends inside the file
TENSOR_ALIGNMENT = 64  # inside a layer: every element size and a cache line; layer starts are ALIGNMENT-aligned
MODES = ("dense", "endor", "endor+more-resident")
COMPUTES = ("auto", "linear", "decompress")
LINEAR_MAX_TOKENS = 8  # endor_linear keeps up to 8 tokens in registers; longer inputs decompress + GEMM
# On an H100 the CUDA endor_linear beats decompress + GEMM at T = 1 (1.14-1.57x) and loses at T = 4 (0.72-0.81x)
# (BENCHMARKS.md, "Endor decompression and `endor_linear`"; an H200 since: 1.08-1.23x at T = 1)
CUDA_LINEAR_MAX_TOKENS = 1
# Prompts decompress an Endor matrix a block of rows at a time, at most this many dense bytes (at least one row), each
# block multiplied while it is in cache: the buffer is charged to the budget beside the layers, and a whole
# OPT-6.7B fc1 (134 MB) would take a layer's room.
DECOMPRESS_BLOCK_BYTES = 8 << 20
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
    if not layers:
        raise unsupported_model(ckpt.config.get("model_type"), "no decoder-layer weights (layers.{i}.*.weight)")
    if sorted(layers) != list(range(len(layers))):
        raise FormatError("layers", f"non-contiguous layer numbers {sorted(layers)[:8]}")
    return [layers[i] for i in range(len(layers))]


def convert_offload(checkpoint: str | os.PathLike | Checkpoint, out_dir: str | os.PathLike, *, dtype: str = "fp16",
                    endor_compress: bool = False, force: bool = False, progress: bool = True) -> Path:
    """Write a layer store of `checkpoint` (a Hugging Face safetensors directory, a GGUF file, or a Checkpoint such
    as `TensorsCheckpoint(config, state_dict)`) at `out_dir`, one tensor in memory at a time. endor_compress: store
    each matrix as Endor where that is smaller than dense (pruned weights); a first pass counts the non-zeros (the
    header declares every length before any data). Atomic (written under a temporary name, then renamed); refuses
    to replace `out_dir` unless `force`, and even then anything but a layer store or an empty directory
    (paths.check_out_dir). Returns `out_dir`, absolute."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out_dir = check_out_dir(out_dir, force, STORE_FILES, None if isinstance(checkpoint, Checkpoint) else checkpoint)
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
            compressed = name in nnz and \
                nnz[name] * item + rows * ((cols + 7) // 8) + (rows + 1) * 8 < rows * cols * item
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
    tmp = staging_dir(out_dir)
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
        save_tensors(resident, tmp / RESIDENT_FILE, {"magic": MAGIC, "format_version": FORMAT_VERSION})
        _verify(LayerStore(tmp), ckpt, torch_dtype)
        install_dir(tmp, out_dir, STORE_FILES)
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
    """An opened, validated layer store (see the module doc). Raises FileNotFoundError where there is none (saying
    what is there instead), FormatError naming file and field for a broken one.

    layers[l]: the MatrixEntry of each Linear weight of decoder layer l; layer_range(l): (file offset, bytes) of the
    layer's one aligned read range; dense_bytes(l) / stored_bytes(l): its weights dense / as stored."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.layers_path = str(self.path / LAYERS_FILE)
        self.resident_path = str(self.path / RESIDENT_FILE)
        if not os.path.lexists(self.layers_path):
            hint = ("it does not exist" if not self.path.exists() else
                    "it is a flash store: load_flash / flashllm run" if (self.path / BUNDLES_FILE).is_file() else
                    "a checkpoint? convert_offload / flashllm offload --convert writes a layer store from it"
                    if (self.path / "config.json").is_file() else f"no {LAYERS_FILE} in it")
            raise FileNotFoundError(f"{self.path} is not a layer store ({hint})")
        header = read_header(self.layers_path)
        meta = header.metadata
        resident = read_header(self.resident_path)
        resident_meta = resident.metadata
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
        self.config = parse_model_config(meta.get("config"), self.layers_path, resident.tensors)
        try:
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
        self._resident = ResidentFile(self.resident_path)

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
        return self._resident.tensor(name)

    def close_resident(self) -> None:
        self._resident.close()

    def __repr__(self) -> str:
        return (f"LayerStore({str(self.path)!r}, layers={self.n_layers}, dtype={self.dtype}, endor={self.endor}, "
                f"{sum(self.stored_bytes(i) for i in range(self.n_layers)) / 1e6:.1f} MB stored of "
                f"{sum(self.dense_bytes(i) for i in range(self.n_layers)) / 1e6:.1f} MB dense)")


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
    """A decoder layer's Linear whose weight the runtime provides per forward: dense or Endor, resident or in a
    slot. The bias (if any) stays a parameter here."""

    def __init__(self, runtime: OffloadRuntime, layer: int, name: str, shape: tuple[int, int],
                 bias: nn.Parameter | None):
        super().__init__()
        self.runtime, self.layer, self.name = runtime, layer, name
        self.out_features, self.in_features = shape
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.runtime.linear(x, self.runtime.weight(self.layer, self.name), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, layer={self.layer}, "
                f"{self.runtime.placement.tier(self.layer)}")


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
class OffloadRuntime:
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
    stats: OffloadStats = field(default_factory=OffloadStats)
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
        self._decompress = torch.empty(p.decompress_bytes // self.store.dtype.itemsize, dtype=self.store.dtype,
                                       device=self.device)
        self._row_ids = torch.arange(max((e.shape[0] for layer in self.store.layers for e in layer if e.endor),
                                         default=0), device=self.device)

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
    def weight(self, layer: int, name: str) -> torch.Tensor | endor.EndorTensor:
        if layer < self.layers_on_device:
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
        max_tokens = CUDA_LINEAR_MAX_TOKENS if self._cuda else LINEAR_MAX_TOKENS
        if self.compute == "linear" or (self.compute == "auto" and flat.shape[0] <= max_tokens):
            y = ops.endor_linear(flat, w.values, w.bitmap, w.row_offsets, n_cols=cols, bias=bias)
        else:
            block = decompress_block_rows(rows, cols, self.store.dtype.itemsize)
            parts = []
            for first in range(0, rows, block):
                n = min(block, rows - first)
                start = self._clock()
                dense = ops.endor_decompress(w.values, w.bitmap, w.row_offsets, n_cols=cols,
                                             rows=None if n == rows else self._row_ids[first:first + n],
                                             out=self._decompress[:n * cols].view(n, cols))
                self.stats.decompress_s += self._clock() - start
                parts.append(F.linear(flat, dense, None if bias is None else bias[first:first + n]))
            y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return y.reshape(*x.shape[:-1], rows)

    def _clock(self) -> float:
        """time.perf_counter() once the device's queued work has run (CUDA), so the parts get device time."""
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()

    def before_layer(self, layer: int) -> None:
        if self._closed:
            raise RuntimeError("offload: this runtime is closed (close() or unpatch()): load the model again to run it")
        if layer == 0:
            self.stats.forwards += 1
        if layer >= self.layers_on_device:
            self._ensure(layer)
        self._layer_start = self._clock()
        self._decompress_at_start = self.stats.decompress_s

    def after_layer(self, layer: int) -> None:
        moved = layer >= self.layers_on_device
        if self._cuda and moved:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._slot_free[self._slot_of[layer]] = event
        if moved and len(self._slots) == 1:  # the slot is free once this layer's compute is: the next fetch starts
            self._prefetch_after(layer, 0)
        spent = self._clock() - self._layer_start
        self.stats.compute_s += spent - (self.stats.decompress_s - self._decompress_at_start)

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
                    raise RuntimeError(f"offload: reading layer {layer} from {self.store.layers_path} failed: "
                                       f"{e}") from e
                fetched = None  # a fetch nobody needs any more (an earlier forward stopped early): its error too
            wait = time.perf_counter() - start
            slot = pending.slot  # written by the fetch, done now: this layer goes there either way
            if pending.layer == layer:
                self.stats.read_wait_s += wait
                self._account(fetched)
        if pending is None or pending.layer != layer:
            start = time.perf_counter()
            try:
                fetched = self._fetch(layer, slot, self._slot_free[slot])
            except Exception as e:
                raise RuntimeError(f"offload: reading layer {layer} from {self.store.layers_path} failed: "
                                   f"{e}") from e
            self.stats.read_wait_s += time.perf_counter() - start
            self._account(fetched)
        self._slot_of[layer] = slot
        if len(self._slots) == 2:
            self._prefetch_after(layer, 1 - slot)

    def _prefetch_after(self, layer: int, slot: int) -> None:
        """Start fetching the moved layer after `layer` (cyclically: the last one's successor is the first moved
        layer of the next forward) into `slot`, in the background thread, after the compute that last used it."""
        position = self.moved_layers.index(layer)
        following = self.moved_layers[(position + 1) % len(self.moved_layers)]
        self._pending = _Pending(following, slot, self._executor.submit(self._fetch, following, slot,
                                                                        self._slot_free[slot]))

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
        return self.reader.read_rows(offset, ALIGNMENT, size // ALIGNMENT, self._ids[:size // ALIGNMENT], out)

    def _account(self, fetched: _Fetched) -> None:
        self.stats.bytes_read += fetched.bytes_read
        self.stats.n_reads += fetched.n_reads
        self.stats.bytes_moved += fetched.bytes_moved
        self.stats.read_wall_s += fetched.wall_s

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
        """Per forward (a decode step = one token): read (exposed) / read wall / decompress / compute ms, bytes read
        and reads, bytes moved from host memory to the device, plus the placement and the accounted bytes."""
        s, p = self.stats, self.placement
        per = 1e3 / max(s.forwards, 1)
        tokens = max(s.forwards, 1)
        return {"mode": self.mode, "compute": self.compute, "device": str(self.device), "forwards": s.forwards,
                "read_path": self.read_path, "read_ms": s.read_wait_s * per, "read_wall_ms": s.read_wall_s * per,
                "decompress_ms": s.decompress_s * per, "compute_ms": s.compute_s * per,
                "bytes_read_per_token": s.bytes_read / tokens, "reads_per_token": s.n_reads / tokens,
                "bytes_moved_per_token": s.bytes_moved / tokens, "layers_on_device": p.on_device,
                "layers_in_memory": p.in_memory, "layers_on_ssd": self.layers_on_ssd,
                "budget_bytes": self.budget_bytes, "accounted_bytes": self.accounted_bytes,
                "device_budget_bytes": self.device_budget_bytes, "device_accounted_bytes": self.device_accounted_bytes,
                "resident_bytes": self.resident_bytes, "memory_layer_bytes": p.device_layer_bytes + p.host_layer_bytes,
                "staging_bytes": p.slot_bytes + p.decompress_bytes + p.bounce_bytes, "slots": p.slots}

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

    def unpatch(self, model: nn.Module) -> None:
        """Put the original Linear modules back (patch_offload only), remove the hooks, release the reader."""
        if not self.originals:
            raise RuntimeError("this model was built by load_offloaded: it has no original layers to restore")
        if getattr(model, "offload", None) is not self:
            raise RuntimeError("this runtime no longer offloads that model (unpatched already, or not the model it "
                               "patched)")
        self.close()
        for hook in self.hooks:
            hook.remove()
        for parent, attr, module in self.originals:
            setattr(parent, attr, module)
        for attr in ("offload", "offload_stats"):
            model.__dict__.pop(attr, None)


# ------------------------------------------------------------------------------------------ placement, install

@dataclass(frozen=True)
class Placement:
    """Where each decoder layer lives, nearest first, and the bytes that costs.

    Layers [0, on_device) are computed where they lie: in memory on the CPU, in GPU memory on CUDA (dense, or as
    stored in endor+more-resident). Layers [on_device, in_memory) are held in host memory as stored (compressed in
    the Endor modes) and copied into a slot on the device before each use: the GPU's CPU tier. Layers [in_memory,
    n_layers) are read from the store into a slot before each use. On the CPU, on_device == in_memory unless a
    staged tier is asked for (layers_on_device=), which runs the GPU's three-tier code path where there is no GPU.

    device_layer_bytes: the on-device layers; host_layer_bytes: the staged tier (pinned on CUDA, page by page:
    transfer.pinned_buffer); slot_bytes: the `slots` buffers moved layers land in (two: the next layer's fetch
    overlaps this one's compute; one: a layer's room more, the fetch after the compute); decompress_bytes: the
    buffer Endor matrices are decompressed into for prompts, a block of rows at a time (decompress_block_rows);
    bounce_bytes: the pinned host memory SSD layers pass through on their way to a GPU (reader.host_bounce_bytes:
    one buffer as large as a layer when kvikio is absent, kvikio's pool of bounce buffers in its compatibility
    mode)."""
    n_layers: int
    on_device: int
    in_memory: int
    slots: int
    device_layer_bytes: int
    host_layer_bytes: int
    slot_bytes: int
    decompress_bytes: int
    bounce_bytes: int

    @property
    def device_bytes(self) -> int:
        return self.device_layer_bytes + self.slot_bytes + self.decompress_bytes

    @property
    def host_bytes(self) -> int:
        return self.host_layer_bytes + self.bounce_bytes

    def tier(self, layer: int) -> str:
        """"resident" (computed where it lies), "staged" (in host memory, copied to a slot per use) or "ssd"."""
        return "resident" if layer < self.on_device else "staged" if layer < self.in_memory else "ssd"


def decompress_block_rows(rows: int, cols: int, itemsize: int) -> int:
    """Rows of an Endor matrix [rows, cols] a prompt decompresses at a time: DECOMPRESS_BLOCK_BYTES of dense rows, at
    least one, at most all."""
    return max(1, min(rows, DECOMPRESS_BLOCK_BYTES // (cols * itemsize)))


def _placement(store: LayerStore, mode: str, on_device: int, in_memory: int, slots: int,
               bounce: Callable[[int], int] | None) -> Placement:
    n, item = store.n_layers, store.dtype.itemsize
    keep_compressed = mode == "endor+more-resident"
    moved = [store.stored_bytes(i) for i in range(on_device, n)]
    # Endor matrices computed from their compressed form (moved layers, and on-device ones kept compressed) are
    # decompressed into one buffer for prompts, a block of rows at a time.
    decompress = max((decompress_block_rows(*e.shape, item) * e.shape[1] * item for i in range(n)
                      for e in store.layers[i] if e.endor and (i >= on_device or keep_compressed)), default=0)
    largest_on_ssd = max((store.stored_bytes(i) for i in range(in_memory, n)), default=0)
    return Placement(n, on_device, in_memory, slots,
                     sum(store.stored_bytes(i) if keep_compressed else store.dense_bytes(i) for i in range(on_device)),
                     sum(store.stored_bytes(i) for i in range(on_device, in_memory)),
                     slots * max(moved, default=0), decompress,
                     bounce(largest_on_ssd) if bounce and largest_on_ssd else 0)


def plan_placement(store: LayerStore, mode: str, layer_budget: int | None, layers_in_memory: int | None = None, *,
                   device_layer_budget: int | None = None, separate: bool = False,
                   bounce: Callable[[int], int] | None = None,
                   layers_on_device: int | None = None, slots: int = 2) -> Placement:
    """The placement, nearest first, within the budgets left for layers (None: no limit).

    separate=False (the CPU): one pool, `layer_budget`, holds every byte of the Placement; layers_on_device
    defaults to layers_in_memory, i.e. no staged tier. separate=True (a GPU): the device's pool
    (`device_layer_budget`) holds Placement.device_bytes and sets layers_on_device; the host's (`layer_budget`)
    holds Placement.host_bytes (the bounce buffers, `bounce`(bytes of the largest SSD layer), none when None; then
    the staged tier). Given counts are kept if they fit (a placement to compare modes on); otherwise the most layers
    that fit. `slots`: 1 or 2 (Placement). Raises ValueError when given counts do not fit (_BudgetTooSmall, naming
    the pool, when not even zero layers do)."""
    _check_options(store, mode, slots=slots, layers_in_memory=layers_in_memory, layers_on_device=layers_on_device)
    for name, value in (("layer_budget", layer_budget), ("device_layer_budget", device_layer_budget)):
        if value is not None and not _is_int(value):
            raise ValueError(f"{name} must be bytes (an int) or None, got {value!r}")
    n = store.n_layers

    def device_fits(p: Placement) -> bool:
        return not separate or device_layer_budget is None or p.device_bytes <= device_layer_budget

    def host_fits(p: Placement) -> bool:
        need = p.host_bytes if separate else p.host_bytes + p.device_bytes
        return layer_budget is None or need <= layer_budget

    given = layers_in_memory is not None or layers_on_device is not None
    g = layers_on_device
    if separate and g is None:
        on_device = [g for g in range(n + 1) if device_fits(_placement(store, mode, g, g, slots, bounce))]
        if not on_device:
            raise _BudgetTooSmall(_placement(store, mode, 0, 0, slots, bounce).device_bytes, "device")
        g = on_device[-1] if layers_in_memory is None else min(on_device[-1], layers_in_memory)
    if layers_in_memory is not None:
        counts = [(layers_in_memory if g is None else g, layers_in_memory)]
    else:  # without a staged tier (g None) the layers in memory are all on the device
        counts = [(k, k) for k in range(n + 1)] if g is None else [(g, k) for k in range(g, n + 1)]
    plans = [_placement(store, mode, on, k, slots, bounce) for on, k in counts]
    fitting = [p for p in plans if device_fits(p) and host_fits(p)]
    if fitting:
        return fitting[-1]
    p = plans[0]
    if not given:
        raise _BudgetTooSmall(p.host_bytes if separate else p.host_bytes + p.device_bytes, "host")
    if separate:
        raise ValueError(f"{p.on_device} layers on the device and {p.in_memory} in memory in {mode} mode need "
                         f"{p.device_bytes} bytes of device memory and {p.host_bytes} of host memory for the layers "
                         f"and their buffers; the budgets leave {device_layer_budget} and {layer_budget}")
    staged = f" ({p.in_memory - p.on_device} of them staged)" if p.on_device < p.in_memory else ""
    raise ValueError(f"{p.in_memory} layers in memory in {mode} mode{staged} need "
                     f"{p.device_bytes + p.host_bytes} bytes for the layers and staging, {layer_budget} are left of "
                     f"the budget")


def default_slots(device: torch.device) -> int:
    """Fetch slots when none are asked for: one on a GPU, whose decode layer computes in milliseconds beside a fetch
    of hundreds, so the room for one more layer in memory is worth more than the overlap (1.28-1.52x per token on an
    H200, BENCHMARKS.md "GPU run"); two on the CPU, where a layer's compute is long enough to hide a fetch."""
    return 1 if device.type == "cuda" else 2


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_options(store: LayerStore, mode: str, *, compute: str = "auto", threads: int = 1, slots: int | None = 2,
                   layers_in_memory: int | None = None, layers_on_device: int | None = None) -> None:
    """ValueError (TypeError for a store that is not a LayerStore) naming the first bad argument, before any work."""
    if not isinstance(store, LayerStore):
        raise TypeError(f"store must be a LayerStore, got {type(store).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if (mode != "dense") != store.endor:
        raise ValueError(f"{mode} mode needs {'an Endor' if mode != 'dense' else 'a dense'} layer store; {store.path} "
                         f"is {'Endor' if store.endor else 'dense'} (convert_offload endor_compress=)")
    if compute not in COMPUTES:
        raise ValueError(f"compute must be one of {COMPUTES}, got {compute!r}")
    if not _is_int(threads) or not 1 <= threads <= MAX_THREADS:
        raise ValueError(f"threads must be an int in [1, {MAX_THREADS}], got {threads!r}")
    if slots is not None and (not _is_int(slots) or slots not in (1, 2)):
        raise ValueError(f"slots must be 1, 2 or None, got {slots!r}")
    n = store.n_layers
    for name, value in (("layers_on_device", layers_on_device), ("layers_in_memory", layers_in_memory)):
        if value is not None and (not _is_int(value) or not 0 <= value <= n):
            raise ValueError(f"{name} must be an int in [0, {n}], got {value!r}")
    if layers_on_device is not None and layers_in_memory is not None and layers_on_device > layers_in_memory:
        raise ValueError(f"layers_on_device ({layers_on_device}) exceeds layers_in_memory ({layers_in_memory})")


class _BudgetTooSmall(ValueError):
    def __init__(self, need: int, pool: str):
        super().__init__(f"offloading needs at least {need} bytes of {pool} memory for the layers' buffers, beside "
                         f"the resident tensors")
        self.need, self.pool = need, pool




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
             threads: int, keep_originals: bool, device: torch.device, layers_in_memory: int | None = None,
             device_budget: int | float | str | None = None, layers_on_device: int | None = None,
             slots: int | None = None, progress: bool = False) -> OffloadRuntime:
    if getattr(model, "offload", None) is not None:
        raise ValueError("this model is already offloaded: unpatch it first")
    separate = device.type == "cuda"
    slots = default_slots(device) if slots is None else slots
    if device_budget is not None and not separate:
        raise ValueError("device_budget is the GPU memory for layers on a CUDA device; on the CPU dram_budget is the "
                         "one budget")
    linear_slots = _linear_slots(model, store)
    params = [p for p in model.parameters() if p.device.type != "meta" and p.is_floating_point()]
    if params and params[0].dtype != store.dtype:
        raise ValueError(f"the model is {params[0].dtype}, the store {store.path} {store.dtype}: load the model in "
                         f"the store's dtype")
    weights = {id(s[2].weight) for layer in linear_slots for s in layer if isinstance(s[2], nn.Linear)}
    resident = _tensor_bytes([p for p in model.parameters() if id(p) not in weights] + list(model.buffers()))
    model_bytes = resident + sum(store.dense_bytes(i) for i in range(store.n_layers))
    budget_bytes = None if budget is None else parse_budget(budget, model_bytes)
    device_budget_bytes = None if device_budget is None else parse_budget(device_budget, model_bytes,
                                                                          "device_budget")
    # On the CPU the resident tensors share the one budget with the layers; on a GPU they live in device memory.
    host_layer_budget = None if budget_bytes is None else budget_bytes - (0 if separate else resident)
    device_layer_budget = None if device_budget_bytes is None else device_budget_bytes - resident
    read_path = select_read_path(device)
    try:
        placement = plan_placement(store, mode, host_layer_budget, layers_in_memory,
                                   device_layer_budget=device_layer_budget, separate=separate,
                                   bounce=partial(host_bounce_bytes, read_path, threads=threads) if separate else None,
                                   layers_on_device=layers_on_device, slots=slots)
    except _BudgetTooSmall as e:
        if e.pool == "device":
            raise ValueError(f"device_budget of {device_budget_bytes} bytes is below the minimum of "
                             f"{resident + e.need} for {mode} offload on {device} ({resident} resident tensors + "
                             f"{e.need} for {slots} slot(s) of the largest layer and the decompression buffer)"
                             ) from None
        if separate:
            raise ValueError(f"dram_budget of {budget_bytes} bytes is below the minimum of {e.need} for {mode} "
                             f"offload to {device} (the pinned host memory SSD reads pass through on the "
                             f"{read_path!r} read path)") from None
        raise ValueError(f"dram_budget of {budget_bytes} bytes is below the minimum of {resident + e.need} for "
                         f"{mode} offload ({resident} resident tensors + {e.need} for {slots} staging buffer(s) of the "
                         f"largest layer and the decompression buffer)") from None
    runtime = OffloadRuntime(store, mode, compute, device, budget_bytes, device_budget_bytes, resident, placement,
                             threads)
    if runtime.moved_layers:  # the staged layers are read once here, the SSD ones every forward
        runtime.reader = FlashReader.for_file(store.layers_path, threads=threads)
    for i in tqdm(range(placement.in_memory), desc="loading layers into memory", unit="layer",
                  disable=not progress or not placement.in_memory):
        if i >= placement.on_device:  # staged: the stored bytes, pinned on CUDA
            size = store.layer_range(i)[1]
            host = pinned_buffer(size) if separate else aligned_buffer(size)
            runtime.read_layer(i, host)
            runtime.host_layers.append(host)
            continue
        layer = {}  # resident: dense (dense, endor), or as stored (endor+more-resident)
        for e in store.layers[i]:
            w = store.matrix(i, e.name)
            w = w.decompress() if isinstance(w, endor.EndorTensor) and mode != "endor+more-resident" else w
            layer[e.name] = w.to(device)
        runtime.memory.append(layer)
    if placement.in_memory:
        drop_page_cache(store.layers_path)
    for i, layer_slots in enumerate(linear_slots):
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
                  dram_budget: int | float | str | None = None, compute: str = "auto", threads: int = 32,
                  device_budget: int | float | str | None = None, slots: int | None = None) -> OffloadRuntime:
    """Offload the decoder layers of an already loaded Llama-family or OPT model (in the store's dtype, on the CPU
    or a CUDA device: the layers are computed where the model is) to `store` (converted from the same weights). The
    original Linear modules are kept for `unpatch`, so they still occupy memory: for a real budget use
    load_offloaded. Returns the runtime; `runtime.unpatch(model)` restores the model."""
    store = store if isinstance(store, LayerStore) else LayerStore(store)
    _check_options(store, mode, compute=compute, threads=threads, slots=slots)
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    return _install(model, store, mode, dram_budget, compute, threads, keep_originals=True,
                    device=cuda_device(device), device_budget=device_budget, slots=slots)


def load_offloaded(store_dir: str | os.PathLike, dram_budget: int | float | str | None = "30%", *,
                   mode: str = "endor", compute: str = "auto", threads: int = 32,
                   layers_in_memory: int | None = None, device: str | torch.device = "cpu",
                   device_budget: int | float | str | None = None, layers_on_device: int | None = None,
                   slots: int | None = None, progress: bool = True) -> nn.Module:
    """A Hugging Face causal LM built from a layer store, computed on `device` ("cpu" or "cuda").

    On the CPU its decoder layers are in memory or on SSD by `dram_budget` (bytes, "30%" of the dense model, or
    "2GB"; None: no limit): the most layers that fit, or `layers_in_memory` (e.g. another mode's placement, to
    compare on the same one; ValueError if it does not fit). On CUDA, as Endor does, the resident tensors and the
    first layers live in GPU memory by `device_budget` (None: all of them), the next ones in host memory by
    `dram_budget` (as stored: compressed in the Endor modes, copied to the GPU and decompressed there for each
    use), the rest on SSD, read straight into GPU memory (kvikio) or through a pinned buffer. `layers_on_device`
    forces the first tier; on the CPU it keeps layers [layers_on_device, layers_in_memory) as stored bytes copied
    into a slot for each use: the GPU's code path, run where there is no GPU (see Placement). `slots`: the buffers
    moved layers are fetched into, charged to the device's budget (the one budget on the CPU): two (the next
    layer's fetch overlaps this layer's compute) or one (a layer's room more, for a device whose compute is short
    beside a fetch); None: default_slots(device). Only the resident tensors and the placed layers are materialised, in the store's dtype (a
    progress bar while the layers load, unless progress=False). `model.offload_stats()` reports per-token costs."""
    store = LayerStore(store_dir)
    _check_options(store, mode, compute=compute, threads=threads, slots=slots, layers_in_memory=layers_in_memory,
                   layers_on_device=layers_on_device)
    device = cuda_device(device)
    model = empty_model(store.config, store.dtype, store.path)
    assign_resident(model, store, store.dtype)
    _install(model, store, mode, dram_budget, compute, threads, keep_originals=False, device=device,
             layers_in_memory=layers_in_memory, device_budget=device_budget, layers_on_device=layers_on_device,
             slots=slots, progress=progress)
    leftover = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if leftover:
        raise ValueError(f"{store.path}: the store has no tensor for {leftover[:3]} ({len(leftover)} in all)")
    return model.to(device).eval()
