"""The flash weight store: FFN weights bundled per neuron on disk, everything else resident in DRAM.

A store is a directory with two safetensors files (docs/design.md §5):
  bundles.safetensors   per layer `layers.{l}.bundles` [n_neurons, bundle_width], bundle = [up_col | gate_col | down_row]
                        (gate only for GLU models), each tensor on an `alignment`-byte boundary of the file so that
                        neuron i of layer l is one contiguous, direct-I/O-friendly range. With Endor compression the
                        layer is `layers.{l}.bundles.rows` (uint8: per neuron its bitmap row, then its non-zero
                        values, back to back, so a neuron is still one contiguous read, of ~56% of the bytes at
                        50% sparsity) and `layers.{l}.bundles.row_offsets` (int64 [n_neurons + 1], the Endor
                        row offsets of the values; neuron i starts at byte i * ceil(width/8) + row_offsets[i] *
                        itemsize of `.rows`, endor.row_starts).
                        Quantized stores (`bundle_format` "<in>+<down>", e.g. "q4_0+q8_0") hold uint8
                        `layers.{l}.bundles` [n_neurons, row_bytes]: a neuron's up, gate and down rows in GGUF's
                        blocks of 32 weights with their scales (flashllm_ext.ops.blocks.BundleFormat), so a neuron is
                        still one contiguous read, of 2.6-3.5x fewer bytes than float16.
  resident.safetensors  embeddings, attention, norms, biases: what stays in memory (float tensors in `dtype`).
Both headers carry `magic` and `format_version`; bundles.safetensors also the model config, dtype, bundle format,
widths, alignment and `ffn_roles`: per layer, the checkpoint tensor name of each FFN role (WEIGHT_ROLES, whose
weights are the bundles, and BIAS_ROLES present in the model, which are resident tensors under that name), so nothing
reading a store re-derives names from a model family's naming scheme. A quantized store also records per layer how
each FFN weight reached it (`tensor_sources`: its blocks kept from a GGUF, or quantized from another type).
Mixture-of-experts stores (`experts`: {"count": E, "size": m}, FlashStore.experts) hold each layer's E experts as its
E * m neurons, expert e the rows [e * m, (e + 1) * m): an expert is one contiguous range, read in one go; its
ffn_roles name expert e's tensors with EXPERT_FIELD in place of e. The router and shared experts are resident.
A placed store (`neuron_order`: per layer the model neuron of each bundle row, FlashStore.neuron_order, by frequency
or co-activation: flashllm_ext.predictor.placement) holds its rows, and its per-neuron biases, in that order.
`flashllm_ext.flash.convert` writes a store, `FlashStore` opens and validates one.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashllm_ext import endor
from flashllm_ext.errors import FormatError
from flashllm_ext.flash.store_header import (  # noqa: F401  (the store's names, imported from here by its users)
    ALIGNMENT,
    BIAS_ROLES,
    BUNDLES_FILE,
    CONFIG_SIZES,
    DENSE_FORMAT,
    DTYPES,
    EXPERT_FIELD,
    FORMAT_VERSION,
    MAGIC,
    READABLE_VERSIONS,
    RESIDENT_FILE,
    WEIGHT_ROLES,
    ExpertLayout,
    check_entry,
    expert_name,
    check_magic,
    int_field,
    layer_specs,
    layer_tensor_name,
    parse_bundle_format,
    parse_experts,
    parse_ffn_roles,
    parse_model_config,
    neuron_order_problem,
    parse_neuron_order,
    parse_resident_formats,
    parse_tensor_sources,
)
from flashllm_ext.io.safetensors import ResidentFile, read_header
from flashllm_ext.ops.blocks import QuantizedWeight


def neuron_ids(ids: torch.Tensor | list[int]) -> torch.Tensor:
    """`ids` as a flat int64 tensor. Float and bool ids are refused, not converted: int64 would truncate 0.7 to
    neuron 0, a read of a neuron nobody asked for."""
    if isinstance(ids, torch.Tensor) and ids.dtype == torch.int64 and ids.dim() == 1:
        return ids  # (every cache step's ids: no conversion to dispatch)
    ids = torch.as_tensor(ids)
    if ids.numel() and (ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool):
        raise ValueError(f"neuron ids must be integers, got {ids.dtype}")
    return ids.to(torch.int64).reshape(-1)


@dataclass(frozen=True)
class LayerLocation:
    """Where a layer's bundles lie in bundles.safetensors (absolute byte offsets), for the native reader."""

    offset: int
    row_bytes: int
    n_neurons: int


@dataclass(frozen=True)
class EndorLocation:
    """Where an Endor layer's rows lie in bundles.safetensors, for the native reader: neuron i spans bytes
    [offset + starts[i], offset + starts[i + 1]), its bitmap (head_bytes) then its values."""

    offset: int
    starts: torch.Tensor  # int64 [n_neurons + 1], relative to offset
    row_offsets: torch.Tensor  # int64 [n_neurons + 1], the Endor row offsets of the values
    head_bytes: int

    @property
    def counts(self) -> torch.Tensor:
        """Values per neuron, int64 [n_neurons]."""
        return self.row_offsets.diff()


class ResidentWeights:
    """A store's resident tensors, some weights held as GGUF blocks: what FlashStore and the offload LayerStore
    share. Needs `_resident` (an io.safetensors.ResidentFile), `resident_formats` (parse_resident_formats) and
    `dtype`."""

    _resident: ResidentFile
    resident_formats: dict[str, tuple[str, int]]
    dtype: torch.dtype

    def resident_tensor(self, name: str) -> torch.Tensor:
        """One resident tensor, read through the store's one handle of resident.safetensors into memory of its own;
        a weight held as blocks (resident_formats) dequantized to the store's dtype (resident_weight keeps them)."""
        weight = self.resident_weight(name)
        return weight.dequantize(self.dtype) if isinstance(weight, QuantizedWeight) else weight

    def resident_weight(self, name: str) -> torch.Tensor | QuantizedWeight:
        """One resident tensor as stored: a QuantizedWeight for the weights held as blocks (resident_formats)."""
        tensor = self._resident.tensor(name)
        if name in self.resident_formats:
            fmt, cols = self.resident_formats[name]
            return QuantizedWeight(tensor, fmt, cols)
        return tensor


class FlashStore(ResidentWeights):
    """An opened, validated flash store. Raises FormatError naming file and field on any inconsistency.

    `shared()` holds the store's one FlashReader (reader.shared_reader), used by every NeuronCache over it; `close()`
    (or leaving a `with` block) shuts it down.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.bundles_path = str(self.path / BUNDLES_FILE)
        self.resident_path = str(self.path / RESIDENT_FILE)
        header = read_header(self.bundles_path)
        meta = header.metadata
        check_magic(meta, self.bundles_path)
        resident_header = read_header(self.resident_path)
        check_magic(resident_header.metadata, self.resident_path)
        self._resident_entries = resident_header.tensors
        self.resident_formats = parse_resident_formats(
            resident_header.metadata.get("resident_formats"), self._resident_entries, self.resident_path
        )
        self.dtype_name = meta.get("dtype")
        if self.dtype_name not in DTYPES:
            raise FormatError(
                "__metadata__.dtype", f"must be one of {sorted(DTYPES)}, got {self.dtype_name!r}", self.bundles_path
            )
        self.dtype = DTYPES[self.dtype_name]
        ints = {
            key: int_field(meta, key, self.bundles_path)
            for key in ("bundle_width", "n_layers", "n_neurons", "hidden_size", "glu", "alignment", "endor")
        }
        self.bundle_width, self.n_layers, self.n_neurons = ints["bundle_width"], ints["n_layers"], ints["n_neurons"]
        self.hidden_size, self.glu, self.alignment = ints["hidden_size"], bool(ints["glu"]), ints["alignment"]
        self.endor = bool(ints["endor"])
        if self.alignment & (self.alignment - 1) or self.alignment < 512:
            raise FormatError(
                "__metadata__.alignment", f"must be a power of two >= 512, got {self.alignment}", self.bundles_path
            )
        if self.bundle_width != (3 if self.glu else 2) * self.hidden_size:
            raise FormatError(
                "__metadata__.bundle_width",
                f"{self.bundle_width} disagrees with hidden_size {self.hidden_size} and glu={self.glu}",
                self.bundles_path,
            )
        self.config = parse_model_config(meta.get("config"), self.bundles_path, self._resident_entries)
        self.bundle_format = parse_bundle_format(meta, self.endor, self.bundles_path)
        if self.bundle_format is None:
            self.row_bytes = self.bundle_width * self.dtype.itemsize
            self.row_width, self.row_dtype = self.bundle_width, self.dtype
        else:
            self.row_bytes = self.bundle_format.row_bytes(self.hidden_size, self.glu)
            self.row_width, self.row_dtype = self.row_bytes, torch.uint8
        self._entries = header.tensors
        self._endor_index: dict[int, EndorLocation] = {}
        if self.endor and f"{layer_tensor_name(0)}.values" in self._entries:
            raise FormatError(
                "__metadata__.endor",
                "Endor layers in the older layout (separate values and bitmap tensors): convert the checkpoint again",
                self.bundles_path,
            )
        for layer in range(self.n_layers):
            quantized = None if self.bundle_format is None else self.row_bytes
            endor_nnz = -1 if self.endor else None
            for spec in layer_specs(layer, self.n_neurons, self.bundle_width, self.dtype, endor_nnz, quantized):
                check_entry(self._entries, spec, self.alignment, self.bundles_path)
        self.ffn_roles = parse_ffn_roles(
            meta.get("ffn_roles"),
            self.n_layers,
            self.glu,
            self.hidden_size,
            self.n_neurons,
            self._resident_entries,
            self.bundles_path,
        )
        self.tensor_sources = parse_tensor_sources(meta.get("tensor_sources"), self.ffn_roles, self.bundles_path)
        self.experts = parse_experts(meta.get("experts"), self.n_neurons, self.ffn_roles, self.bundles_path)
        self.neuron_order = parse_neuron_order(
            meta.get("neuron_order"), self.n_layers, self.n_neurons, self.experts, self.bundles_path
        )
        self._shared: dict[str, Any] = {}
        self._shared_lock = threading.Lock()
        self._resident = ResidentFile(self.resident_path)

    def shared(self, key: str, open_shared: Callable[[], Any]) -> Any:
        """The store's one object under `key`, made by `open_shared()` on first use and closed (its `close()`) with the
        store: what every user of the store must share rather than each open its own, as its FlashReader
        (reader.shared_reader: a pool of worker threads and a file descriptor). Safe to call concurrently."""
        with self._shared_lock:
            if key not in self._shared:
                self._shared[key] = open_shared()
            return self._shared[key]

    def close(self) -> None:
        """Closes the shared objects (the shared reader: its threads and file descriptor) and the resident file if they
        were opened; later calls open them again."""
        with self._shared_lock:
            shared, self._shared = list(self._shared.values()), {}
        for thing in shared:
            thing.close()
        self.close_resident()

    def __enter__(self) -> FlashStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def quantized(self) -> bool:
        """Whether the bundles are quantized blocks (bundle_format), not floats in `dtype`."""
        return self.bundle_format is not None

    def layer_location(self, layer: int) -> LayerLocation:
        """Absolute file offset and row size of a dense layer, for FlashReader."""
        self._check_layer(layer)
        if self.endor:
            raise ValueError(f"{self.bundles_path}: Endor stores have variable-size bundles; use endor_location()")
        entry = self._entries[layer_tensor_name(layer)]
        return LayerLocation(entry.begin, self.row_bytes, self.n_neurons)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.n_layers})")

    def check_ids(self, ids: torch.Tensor | list[int]) -> torch.Tensor:
        ids = neuron_ids(ids)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.n_neurons):
            raise ValueError(
                f"neuron ids must lie in [0, {self.n_neurons}), got min {int(ids.min())} max {int(ids.max())}"
            )
        return ids

    def bundle(self, layer: int, ids: torch.Tensor | list[int]) -> torch.Tensor:
        """Bundles of neurons `ids` (any order, repeats allowed) of `layer` as stored: [len(ids), row_width] of
        row_dtype (float bundles, or a quantized store's uint8 rows; float_bundle dequantizes them).

        Plain buffered reads (os.pread, one per run of consecutive neurons); FlashReader is the fast path.
        """
        self._check_layer(layer)
        ids = self.check_ids(ids)
        unique, inverse = torch.unique(ids, return_inverse=True)
        if self.endor:
            rows = self._endor_rows(layer, unique)
        else:
            entry = self._entries[layer_tensor_name(layer)]
            rows = self._read_runs(
                unique, lambda a, b: (entry.begin + a * self.row_bytes, entry.begin + b * self.row_bytes)
            )
            rows = rows.view(self.row_dtype).view(-1, self.row_width)
        return rows[inverse]

    def float_bundle(self, layer: int, ids: torch.Tensor | list[int]) -> torch.Tensor:
        """Bundles of neurons `ids` of `layer` as floats: [len(ids), bundle_width] of self.dtype (a quantized store's
        rows dequantized)."""
        return self.float_rows(self.bundle(layer, ids))

    def ffn_weights(self, layer: int) -> dict[str, torch.Tensor]:
        """`layer`'s FFN matrices as floats (self.dtype) by their checkpoint names (ffn_roles): up and gate [n, d],
        down [d, n], as the checkpoint held them (a quantized store's dequantized)."""
        d, roles = self.hidden_size, self.ffn_roles[layer]
        bundles = self.float_bundle(layer, torch.arange(self.n_neurons))
        parts = {"up": bundles[:, :d], "gate": bundles[:, d : 2 * d], "down": bundles[:, -d:].t()}
        return {roles[role]: parts[role].contiguous() for role in parts if role in roles}

    def float_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Bundle rows as stored [R, row_width] (row_dtype) -> as floats [R, bundle_width] of self.dtype (a quantized
        store's dequantized, on their device; float rows as they are)."""
        if self.bundle_format is None:
            return rows
        return self.bundle_format.dequantize(rows, self.hidden_size, self.glu).to(self.dtype)

    def _read_runs(self, sorted_ids: torch.Tensor, span: Callable[[int, int], tuple[int, int]]) -> torch.Tensor:
        """Concatenated bytes of span(a, b) for each run a..b-1 of consecutive ids, as uint8."""
        chunks = []
        with open(self.bundles_path, "rb", buffering=0) as f:
            for a, b in _runs(sorted_ids.tolist()):
                begin, end = span(a, b)
                data = os.pread(f.fileno(), end - begin, begin)
                if len(data) != end - begin:
                    raise FormatError(
                        "data",
                        f"short read at offset {begin}: {len(data)} of {end - begin} bytes (file truncated?)",
                        self.bundles_path,
                    )
                chunks.append(data)
        return (
            torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
            if chunks
            else torch.empty(0, dtype=torch.uint8)
        )

    def _endor_rows(self, layer: int, sorted_ids: torch.Tensor) -> torch.Tensor:
        loc = self.endor_location(layer)
        rows = self._read_runs(
            sorted_ids, lambda a, b: (loc.offset + int(loc.starts[a]), loc.offset + int(loc.starts[b]))
        )
        try:
            return endor.unpack_rows(rows, loc.counts[sorted_ids], self.bundle_width, self.dtype).decompress()
        except (FormatError, RuntimeError) as e:  # a row's bitmap disagrees with its value count
            raise FormatError(
                f"{layer_tensor_name(layer)}.rows",
                f"neurons {sorted_ids.tolist()[:8]} (row k of the message is the k-th of them) are inconsistent: {e}",
                self.bundles_path,
            ) from None

    def endor_location(self, layer: int) -> EndorLocation:
        """Where an Endor layer's neuron rows lie, for FlashReader. Its row offsets are read and validated once
        (FormatError naming the field on any inconsistency) and kept: [n_neurons + 1] int64, small."""
        self._check_layer(layer)
        if not self.endor:
            raise ValueError(f"{self.bundles_path}: not an Endor store; use layer_location()")
        location = self._endor_index.get(layer)
        if location is None:
            name = layer_tensor_name(layer)
            rows = self._entries[f"{name}.rows"]
            entry = self._entries[f"{name}.row_offsets"]
            with open(self.bundles_path, "rb", buffering=0) as f:
                raw = os.pread(f.fileno(), entry.end - entry.begin, entry.begin)
            if len(raw) != entry.end - entry.begin:
                raise FormatError(f"{name}.row_offsets", "short read (file truncated?)", self.bundles_path)
            row_offsets = torch.frombuffer(bytearray(raw), dtype=torch.int64)
            width, item = (self.bundle_width + 7) // 8, self.dtype.itemsize
            counts = row_offsets.diff()
            if int(row_offsets[0]) != 0 or bool((counts < 0).any()) or bool((counts > self.bundle_width).any()):
                raise FormatError(
                    f"{name}.row_offsets",
                    f"must rise from 0 by at most the bundle width {self.bundle_width} per neuron",
                    self.bundles_path,
                )
            starts = endor.row_starts(row_offsets, width, item)
            if int(starts[-1]) != rows.end - rows.begin:
                raise FormatError(
                    f"{name}.row_offsets",
                    f"describe {int(starts[-1])} bytes of rows, {name}.rows holds {rows.end - rows.begin}",
                    self.bundles_path,
                )
            location = EndorLocation(rows.begin, starts, row_offsets, width)
            self._endor_index[layer] = location
        return location

    def layer_bias(self, layer: int, role: str) -> torch.Tensor | None:
        """The resident bias of `layer` in `role` (one of BIAS_ROLES) as stored, None when the model has none."""
        self._check_layer(layer)
        if role not in BIAS_ROLES:
            raise ValueError(f"role must be one of {BIAS_ROLES}, got {role!r}")
        name = self.ffn_roles[layer].get(role)
        return None if name is None else self.resident_tensor(name)

    def resident_names(self) -> list[str]:
        """Names of the resident tensors (embeddings, attention, norms, biases; predictors under `predictor.*`)."""
        return list(self._resident_entries)

    def resident(self) -> dict[str, torch.Tensor]:
        """Every resident tensor under its checkpoint name."""
        return {name: self.resident_tensor(name) for name in self._resident_entries}

    def resident_nbytes(self) -> int:
        """Bytes of the resident tensors as stored (predictors not counted)."""
        return sum(e.end - e.begin for n, e in self._resident_entries.items() if not n.startswith("predictor."))

    def close_resident(self) -> None:
        """Forgets resident.safetensors' header (io.safetensors.ResidentFile); a later resident_tensor() reads it again."""
        self._resident.close()

    def __repr__(self) -> str:
        return (
            f"FlashStore({str(self.path)!r}, layers={self.n_layers}, neurons={self.n_neurons}, "
            f"bundle_width={self.bundle_width}, dtype={self.dtype_name}, "
            f"bundle_format={self.bundle_format.name if self.bundle_format else DENSE_FORMAT}, glu={self.glu}, "
            f"endor={self.endor}{'' if self.neuron_order is None else ', placed'})"
        )


def _runs(sorted_unique: list[int]) -> Iterator[tuple[int, int]]:
    """Maximal runs of consecutive integers as half-open (first, last + 1) pairs."""
    start = prev = None
    for i in sorted_unique:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            yield start, prev + 1
            start = prev = i
    if start is not None:
        yield start, prev + 1
