"""Validated reading of safetensors headers, shared by every loader.

safetensors itself rejects malformed files, but with messages that do not name our fields; this parser checks
the header before any data is touched and raises FormatError naming the file and the field.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

from .errors import FormatError

MAX_HEADER_BYTES = 100 << 20  # the limit the safetensors library itself enforces
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}


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


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Parse and validate a safetensors header: sizes, dtypes, shapes and data offsets (in range, no overlap)."""
    path = os.fspath(path)
    try:
        file_size = os.path.getsize(path)
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
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
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
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_size):
        raise FormatError(f"{name}.data_offsets", f"{offsets!r} outside the {data_size}-byte data section", path)
    nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise FormatError(f"{name}.data_offsets", f"span of {offsets[1] - offsets[0]} bytes, shape {shape} "
                          f"of {dtype} needs {nbytes}", path)
    return TensorEntry(dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])
