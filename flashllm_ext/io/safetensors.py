"""Validated reading of safetensors headers, shared by every loader.

safetensors itself rejects malformed files, but with messages that do not name our fields; this parser checks
the header before any data is touched and raises FormatError naming the file and the field.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from flashllm_ext.errors import FormatError
from flashllm_ext.io.paths import create_file, regular_file

MAX_HEADER_BYTES = 100 << 20  # the limit the safetensors library itself enforces
DTYPE_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    path: str
    metadata: dict[str, str]
    tensors: dict[str, TensorEntry]
    data_start: int


def owned_tensor(handle, name: str) -> torch.Tensor:
    """`handle.get_tensor(name)` (a safetensors `safe_open` handle) copied into memory of its own. safetensors hands
    out views of a private mapping of the file: clean file pages, which a memory cgroup may evict and fault in again
    from storage on every use, so a tensor meant to stay in DRAM (resident weights, in-memory layers) must not be
    one (docs/history.md, "Offload": in-memory layers as views of the mapping ran at half speed)."""
    return handle.get_tensor(name).clone()


# The page cache one resident read may hold before it is dropped: a cgroup counts it beside the tensor being filled,
# and a 7B model's 262 MB embedding read whole put its process over its limit at load.
RESIDENT_READ_CHUNK = 16 << 20


class ResidentFile:
    """A store's resident.safetensors, each tensor read (pread, RESIDENT_READ_CHUNK bytes at a time) into memory of
    its own and each chunk's range of the page cache dropped after. Never mapped: a mapping keeps every page read as file-backed memory that a memory cgroup counts
    beside the copies until the file is unmapped, which held a Llama-3-8B-shaped store's 1.35 GB of resident tensors
    twice at load and had its process OOM-killed at its limit (as did the OPT-6.7B offload store's 432 MB embeddings,
    docs/history.md, "Offload"). The header is read on first use; close() forgets it."""

    def __init__(self, path: str):
        self.path = path
        self._entries: dict[str, TensorEntry] | None = None
        self._lock = threading.Lock()

    def tensor(self, name: str) -> torch.Tensor:
        with self._lock:
            if self._entries is None:
                self._entries = read_header(self.path).tensors
            entries = self._entries
        entry = entries.get(name)
        if entry is None:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        out = torch.empty(entry.shape, dtype=_TORCH_DTYPES[entry.dtype])
        data = out.view(-1).view(torch.uint8).numpy() if out.numel() else bytearray()
        done, fd = 0, os.open(self.path, os.O_RDONLY)
        try:
            while done < len(data):
                got = os.preadv(fd, [data[done : done + RESIDENT_READ_CHUNK]], entry.begin + done)
                if got == 0:  # (a length of 0 would drop the page cache up to the end of the file)
                    break
                os.posix_fadvise(fd, entry.begin + done, got, os.POSIX_FADV_DONTNEED)
                done += got
        finally:
            os.close(fd)
        if done != entry.end - entry.begin:
            raise FormatError(
                name, f"short read: {done} of {entry.end - entry.begin} bytes (file truncated?)", self.path
            )
        return out

    def close(self) -> None:
        """Forgets the header (a later tensor() reads it again)."""
        with self._lock:
            self._entries = None


def drop_page_cache(path: str | os.PathLike) -> None:
    """Drop the clean cached pages of `path` (posix_fadvise DONTNEED): a file read to load tensors into memory of
    their own stays in the page cache, which a memory cgroup charges to the process until it reclaims it; left
    there, it held an Endor offload child at its limit with its layer reads at half speed (docs/history.md,
    "Offload")."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Parse and validate a safetensors header: sizes, dtypes, shapes and data offsets (in range, no overlap)."""
    path = os.fspath(path)
    try:
        file_size = os.path.getsize(regular_file(path))
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise FormatError("header_size", f"file is {file_size} bytes, too short for a header", path)
            (header_size,) = struct.unpack("<Q", prefix)
            if header_size > MAX_HEADER_BYTES or 8 + header_size > file_size:
                raise FormatError("header_size", f"{header_size} does not fit a {file_size}-byte file", path)
            raw = f.read(header_size)
    except OSError as e:
        raise FormatError("file", f"cannot read: {e}", path) from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError("header", f"not valid UTF-8 JSON ({e})", path) from e
    if not isinstance(header, dict):
        raise FormatError("header", "must be a JSON object", path)
    metadata = header.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise FormatError("__metadata__", "must map strings to strings", path)
    data_start = 8 + header_size
    data_size = file_size - data_start
    tensors: dict[str, TensorEntry] = {}
    for name, info in header.items():
        tensors[name] = _parse_entry(name, info, data_start, data_size, path)
    spans = sorted((t.begin, t.end, n) for n, t in tensors.items() if t.end > t.begin)
    for (_, end_a, name_a), (begin_b, _, name_b) in zip(spans, spans[1:]):
        if begin_b < end_a:
            raise FormatError(f"{name_b}.data_offsets", f"overlaps {name_a}", path)
    return SafetensorsHeader(path, metadata, tensors, data_start)


def _parse_entry(name: str, info: object, data_start: int, data_size: int, path: str) -> TensorEntry:
    if not isinstance(info, dict):
        raise FormatError(name, "entry must be a JSON object", path)
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise FormatError(f"{name}.dtype", f"unknown dtype {dtype!r}", path)
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise FormatError(f"{name}.shape", f"must be a list of non-negative integers, got {shape!r}", path)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_size
    ):
        raise FormatError(f"{name}.data_offsets", f"{offsets!r} outside the {data_size}-byte data section", path)
    nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise FormatError(
            f"{name}.data_offsets",
            f"span of {offsets[1] - offsets[0]} bytes, shape {shape} of {dtype} needs {nbytes}",
            path,
        )
    return TensorEntry(dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


_TORCH_DTYPE_NAMES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


_TORCH_DTYPES = {name: getattr(torch, dtype) for dtype, name in _TORCH_DTYPE_NAMES.items()}


def dtype_name(dtype: object) -> str:
    """safetensors' name of a torch dtype (torch.float16 -> "F16")."""
    name = _TORCH_DTYPE_NAMES.get(str(dtype).removeprefix("torch."))
    if name is None:
        raise ValueError(f"dtype {dtype} has no safetensors name")
    return name


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors name, e.g. "F16"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


def _round_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


PADDING_PREFIX = "__padding__."


class AlignedWriter:
    """Writes a safetensors file in which every tensor starts on an `alignment`-byte boundary of the file.

    The JSON header is padded with trailing spaces (allowed by the format) so the data section starts aligned,
    and zero-filled uint8 tensors named `__padding__.<k>` fill the gaps between tensors (safetensors readers
    reject gaps), so every tensor stays aligned and any safetensors reader opens the result. The
    tensors are declared up front and streamed in that order with `write`, so a store larger than memory can
    be written one tensor at a time. Use as a context manager; `close()` checks every tensor was written.
    `tensor_alignment` (default `alignment`) aligns the tensors apart from the data section: 1 packs them as the
    safetensors library does (no padding tensors; each tensor stays aligned to its element size when the specs
    go from the widest element size to the narrowest), the data section still starting `alignment`-aligned.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        specs: list[TensorSpec],
        metadata: dict[str, str] | None = None,
        alignment: int = 4096,
        tensor_alignment: int | None = None,
    ):
        tensor_alignment = alignment if tensor_alignment is None else tensor_alignment
        for value in (alignment, tensor_alignment):
            if value <= 0 or value & (value - 1):
                raise ValueError(f"alignment must be a power of two, got {value}")
        self.path = os.fspath(path)
        self.specs = list(specs)
        header: dict[str, object] = {"__metadata__": dict(metadata or {})}
        offset = 0
        self.offsets: dict[str, int] = {}  # relative to the data section, as in the header
        for spec in self.specs:
            gap = _round_up(offset, tensor_alignment) - offset
            if gap:
                # safetensors rejects gaps between tensors, so the padding is itself a (zero-filled) tensor.
                name = f"{PADDING_PREFIX}{len(self.offsets)}"
                header[name] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
                offset += gap
            self.offsets[spec.name] = offset
            header[spec.name] = {
                "dtype": spec.dtype,
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        padded = _round_up(8 + len(raw), alignment) - 8
        self.data_start = 8 + padded
        self._file = os.fdopen(create_file(self.path, private=False, exclusive=False), "wb")
        self._file.write(struct.pack("<Q", padded) + raw + b" " * (padded - len(raw)))
        self._next = 0

    def write(self, name: str, tensor: object) -> None:
        """Write the next declared tensor (a torch tensor or numpy array of the declared dtype and shape)."""
        self.write_rows(name, [tensor])

    def write_rows(self, name: str, chunks: Iterable[object]) -> None:
        """Write the next declared tensor from consecutive blocks of its rows (torch tensors or numpy arrays of the
        declared dtype, each of the declared shape but in its first dimension), so that a tensor need never be whole
        in memory (an 8B model's embedding is 2.1 GB in fp32)."""
        if self._next >= len(self.specs) or self.specs[self._next].name != name:
            expected = self.specs[self._next].name if self._next < len(self.specs) else "nothing"
            raise ValueError(f"{self.path}: tensors must be written in declared order, expected {expected}, got {name}")
        spec = self.specs[self._next]
        rows = written = 0
        for chunk in chunks:
            data = tensor_bytes(chunk)
            declared_dtype = dtype_name(chunk.dtype) if hasattr(chunk, "element_size") else spec.dtype
            shape = tuple(chunk.shape)
            if shape[1:] != spec.shape[1:] or declared_dtype != spec.dtype or written + len(data) > spec.nbytes:
                raise ValueError(
                    f"{name}: declared {spec.dtype}{list(spec.shape)}, got {getattr(chunk, 'dtype', '?')}"
                    f"{list(shape)} (rows from {rows} on)"
                )
            if not written:  # padding up to the tensor's offset once its first block is known to fit
                self._file.write(b"\0" * (self.data_start + self.offsets[name] - self._file.tell()))
            self._file.write(data)
            rows, written = rows + (shape[0] if shape else 1), written + len(data)
        if written != spec.nbytes:
            raise ValueError(f"{name}: declared {spec.dtype}{list(spec.shape)}, got {rows} rows ({written} bytes)")
        self._next += 1

    def close(self) -> None:
        self._file.close()
        if self._next != len(self.specs):
            raise ValueError(f"{self.path}: only {self._next} of {len(self.specs)} declared tensors were written")

    def __enter__(self) -> AlignedWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()


def save_tensors(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None
) -> None:
    """The file safetensors.torch.save_file writes (same packing: widest element first, then by name), through
    paths.create_file: never through a symbolic link, with the umask's mode (save_file's files are 0600)."""
    specs = sorted(
        (TensorSpec(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in tensors.items()),
        key=lambda spec: (-DTYPE_SIZES[spec.dtype], spec.name),
    )
    with AlignedWriter(path, specs, metadata, alignment=8, tensor_alignment=1) as writer:
        for spec in specs:
            writer.write(spec.name, tensors[spec.name])


def tensor_bytes(tensor: object) -> memoryview:
    import numpy as np
    import torch

    from flashllm_ext.ops.bits import BITS_VIEW

    if isinstance(tensor, torch.Tensor):
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        # numpy has no bfloat16: move the bits through a same-width integer view.
        array = flat.view(BITS_VIEW[flat.dtype]).numpy() if flat.dtype == torch.bfloat16 else flat.numpy()
    else:
        array = np.ascontiguousarray(tensor)
    return memoryview(array).cast("B")
