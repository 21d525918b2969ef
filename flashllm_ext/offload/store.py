"""The offload layer store (see flashllm_ext.offload): its format constants and LayerStore, which opens and
validates one."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from flashllm_ext import endor
from flashllm_ext.errors import FormatError
from flashllm_ext.io.safetensors import ResidentFile, TensorEntry, TensorSpec, dtype_name, owned_tensor, read_header
from flashllm_ext.io.buffers import ALIGNMENT
from flashllm_ext.flash.quantized_rows import QUANTIZED_DTYPES, QUANTIZED_FLOAT_DTYPE
from flashllm_ext.flash.store import (
    BUNDLES_FILE,
    DTYPES,
    ResidentWeights,
    parse_model_config,
    parse_resident_formats,
)
from flashllm_ext.ops.blocks import BLOCK_FORMATS, QuantizedWeight


MAGIC = "flashllm-offload"
# 3: a quantized store's embedding and LM head may be GGUF blocks (resident.safetensors' resident_formats); 2: a
# matrix's form is a name ("dense", "endor" or a block format) and the dtype may be a quantized one; 1: the form was
# 0 / 1 for dense / Endor. Versions 1 and 2 are still read; a reader refuses versions it does not know.
FORMAT_VERSION = "3"
READ_VERSIONS = ("1", "2", FORMAT_VERSION)
LAYERS_FILE = "layers.safetensors"
RESIDENT_FILE = "resident.safetensors"
STORE_FILES = (LAYERS_FILE, RESIDENT_FILE)  # what convert_offload writes: --force replaces these only
END_TENSOR = "layers.end"  # zero bytes up to the next block: the last layer's range ends inside the file
TENSOR_ALIGNMENT = 64  # inside a layer: every element size and a cache line; layer starts are ALIGNMENT-aligned


# ------------------------------------------------------------------------------------------------ the store


def round_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class MatrixEntry:
    """One decoder-layer Linear weight in the store: its checkpoint name, shape [rows, cols] and form: "dense"
    (floats in the store's dtype), "endor" (values + bitmap + row offsets) or a block format (ops.blocks: each row
    its GGUF blocks, uint8 [rows, row_bytes(cols)])."""

    name: str
    shape: tuple[int, int]
    form: str

    @property
    def endor(self) -> bool:
        return self.form == "endor"

    @property
    def block_format(self) -> str | None:
        return self.form if self.form in BLOCK_FORMATS else None

    def memory_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of the matrix as it is multiplied: dense floats, or its blocks (a quantized matrix stays quantized
        in memory)."""
        rows, cols = self.shape
        if self.block_format:
            return rows * BLOCK_FORMATS[self.block_format].row_bytes(cols)
        return rows * cols * dtype.itemsize

    def specs(self, dtype: torch.dtype, nnz: int) -> list[TensorSpec]:
        rows, cols = self.shape
        if self.block_format:
            return [TensorSpec(self.name, "U8", (rows, BLOCK_FORMATS[self.block_format].row_bytes(cols)))]
        if not self.endor:
            return [TensorSpec(self.name, dtype_name(dtype), self.shape)]
        return [
            TensorSpec(f"{self.name}.values", dtype_name(dtype), (nnz,)),
            TensorSpec(f"{self.name}.bitmap", "U8", (rows, (cols + 7) // 8)),
            TensorSpec(f"{self.name}.row_offsets", "I64", (rows + 1,)),
        ]


class LayerStore(ResidentWeights):
    """An opened, validated layer store (see the module doc). Raises FileNotFoundError where there is none (saying
    what is there instead), FormatError naming file and field for a broken one.

    dtype: the float dtype of the dense matrices, the resident tensors and the activations (float16 in a quantized
    store); quantized: the quantized dtype ("q8", "q4": its matrices in block formats) or None. layers[l]: the
    MatrixEntry of each Linear weight of decoder layer l; layer_range(l): (file offset, bytes) of the layer's one
    aligned read range; dense_bytes(l) / stored_bytes(l): its weights as multiplied (dense floats, or blocks) / as
    stored. resident_formats: the resident weights held as GGUF blocks (a quantized store's embedding and LM head),
    name -> (block format, columns); resident_weight keeps them as blocks, resident_tensor dequantizes."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.layers_path = str(self.path / LAYERS_FILE)
        self.resident_path = str(self.path / RESIDENT_FILE)
        if not os.path.lexists(self.layers_path):
            hint = (
                "it does not exist"
                if not self.path.exists()
                else "it is a flash store: load_flash / flashllm run"
                if (self.path / BUNDLES_FILE).is_file()
                else "a checkpoint? convert_offload / flashllm offload --convert writes a layer store from it"
                if (self.path / "config.json").is_file()
                else f"no {LAYERS_FILE} in it"
            )
            raise FileNotFoundError(f"{self.path} is not a layer store ({hint})")
        header = read_header(self.layers_path)
        meta = header.metadata
        resident = read_header(self.resident_path)
        resident_meta = resident.metadata
        for file, m in ((self.layers_path, meta), (self.resident_path, resident_meta)):
            if m.get("magic") != MAGIC:
                raise FormatError("__metadata__.magic", f"expected {MAGIC!r}, got {m.get('magic')!r}", file)
            if m.get("format_version") not in READ_VERSIONS:
                raise FormatError(
                    "__metadata__.format_version",
                    f"unsupported version {m.get('format_version')!r} (this library reads {list(READ_VERSIONS)})",
                    file,
                )
        dtypes = [*DTYPES, *QUANTIZED_DTYPES]
        if meta.get("dtype") not in dtypes:
            raise FormatError(
                "__metadata__.dtype", f"must be one of {dtypes}, got {meta.get('dtype')!r}", self.layers_path
            )
        self.quantized = meta["dtype"] if meta["dtype"] in QUANTIZED_DTYPES else None
        self.dtype = DTYPES[QUANTIZED_FLOAT_DTYPE if self.quantized else meta["dtype"]]
        for key, value in (("alignment", ALIGNMENT), ("tensor_alignment", TENSOR_ALIGNMENT)):
            if meta.get(key) != str(value):
                raise FormatError(f"__metadata__.{key}", f"must be {value}, got {meta.get(key)!r}", self.layers_path)
        self.config = parse_model_config(meta.get("config"), self.layers_path, resident.tensors)
        self.format_version = meta["format_version"]
        version_1 = self.format_version == "1"
        try:
            raw_layers = json.loads(meta.get("layers", ""))
            self.layers = [
                [
                    MatrixEntry(str(n), (int(s[0]), int(s[1])), ("endor" if f else "dense") if version_1 else f)
                    for n, s, f in layer
                ]
                for layer in raw_layers
            ]
        except (json.JSONDecodeError, TypeError, ValueError, IndexError) as e:
            raise FormatError(
                "__metadata__.layers", f"not a list of [name, [rows, cols], form] per layer ({e})", self.layers_path
            ) from None
        if not self.layers or not all(self.layers):
            raise FormatError("__metadata__.layers", "no layers, or a layer without weights", self.layers_path)
        allowed = list(BLOCK_FORMATS) if self.quantized else ["dense", "endor"]  # a quantized store's are all blocks
        for e in (e for layer in self.layers for e in layer):
            if e.form not in allowed:
                raise FormatError(
                    f"__metadata__.layers[{e.name}]",
                    f"form must be one of {allowed}, got {e.form!r}",
                    self.layers_path,
                )
        self._entries = header.tensors
        self._ranges = []
        for i, layer in enumerate(self.layers):
            begin = end = None
            for e in layer:
                for spec in e.specs(self.dtype, -1):
                    t = self._entries.get(spec.name)
                    shape_ok = t is not None and (len(t.shape) == 1 if spec.shape == (-1,) else t.shape == spec.shape)
                    if not shape_ok or t.dtype != spec.dtype:
                        raise FormatError(spec.name, f"missing or not {spec.dtype}{list(spec.shape)}", self.layers_path)
                    if t.begin % TENSOR_ALIGNMENT:
                        raise FormatError(
                            f"{spec.name}.data_offsets",
                            f"starts at byte {t.begin}, not on a {TENSOR_ALIGNMENT}-byte boundary",
                            self.layers_path,
                        )
                    begin = t.begin if begin is None else min(begin, t.begin)
                    end = t.end if end is None else max(end, t.end)
            if begin % ALIGNMENT:
                raise FormatError(
                    f"layers[{i}]", f"starts at byte {begin}, not on a {ALIGNMENT}-byte boundary", self.layers_path
                )
            self._ranges.append((begin, round_up(end, ALIGNMENT) - begin))
        last = self._ranges[-1][0] + self._ranges[-1][1]
        if os.path.getsize(self.layers_path) < last:
            raise FormatError(
                END_TENSOR, f"the file ends before byte {last}, the end of the last layer's range", self.layers_path
            )
        try:
            self.tensor_sources: dict[str, str] = json.loads(meta.get("tensor_sources", "{}"))
        except json.JSONDecodeError as e:
            raise FormatError("__metadata__.tensor_sources", f"not JSON ({e})", self.layers_path) from None
        self.resident_formats = parse_resident_formats(
            resident_meta.get("resident_formats"), resident.tensors, self.resident_path
        )
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
        return sum(e.memory_bytes(self.dtype) for e in self.layers[layer])

    def stored_bytes(self, layer: int) -> int:
        return self._ranges[layer][1]

    def entry(self, name: str) -> TensorEntry:
        """Where tensor `name` (a dense matrix or one Endor part) lies in layers.safetensors: absolute offsets."""
        return self._entries[name]

    def matrix(self, layer: int, name: str) -> torch.Tensor | endor.EndorTensor | QuantizedWeight:
        """One weight as stored (dense, a validated EndorTensor, or a QuantizedWeight of its blocks), read with plain
        buffered I/O into memory of its own (owned_tensor)."""
        entry = next((e for e in self.layers[layer] if e.name == name), None)
        if entry is None:
            raise KeyError(f"layer {layer} of {self.path} has no matrix {name!r}")
        with safe_open(self.layers_path, framework="pt") as f:
            if entry.block_format:
                return QuantizedWeight(owned_tensor(f, name), entry.block_format, entry.shape[1])
            if not entry.endor:
                return owned_tensor(f, name)
            parts = [owned_tensor(f, f"{name}.{p}") for p in endor.PARTS]
        return endor.EndorTensor(*parts, entry.shape, source=self.layers_path)

    def resident_names(self) -> list[str]:
        return list(read_header(self.resident_path).tensors)

    def close_resident(self) -> None:
        self._resident.close()

    def close(self) -> None:
        """Release the store's open file (the resident tensors'); the layers are read by their own readers."""
        self.close_resident()

    def __repr__(self) -> str:
        return (
            f"LayerStore({str(self.path)!r}, layers={self.n_layers}, dtype={self.quantized or self.dtype}, "
            f"endor={self.endor}, "
            f"{sum(self.stored_bytes(i) for i in range(self.n_layers)) / 1e6:.1f} MB stored of "
            f"{sum(self.dense_bytes(i) for i in range(self.n_layers)) / 1e6:.1f} MB dense)"
        )
