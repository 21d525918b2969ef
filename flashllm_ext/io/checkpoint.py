"""Checkpoints read one tensor at a time: Hugging Face safetensors directories (sharded or not) and GGUF files (Llama,
and the mixture-of-experts Mixtral, OLMoE, Qwen2-MoE and Qwen3-MoE).

`open_checkpoint(path)` gives a Checkpoint: a Hugging Face style `config`, the tensor `names`, each tensor's `shape`
from the header, and `ckpt[name]` that reads (GGUF: dequantizes) that one tensor only, so converting a 7B model
holds one tensor at a time, not the whole model in fp32; `ckpt.row_chunks(name, max_bytes)` reads one block of
rows at a time (an 8B model's embedding is 2.1 GB in fp32). `GGUFCheckpoint.raw_blocks(name)` gives a tensor's rows
as the file stores them (a quantized type's blocks), for stores that keep them bit for bit.

GGUF tensors equal what `transformers` loads from the same file: both dequantize with `gguf.quants.dequantize`,
and llama.cpp's rotary permutation of a Llama's (and Mixtral's) Q/K rows is undone here as transformers undoes it
(OLMoE and the Qwen MoEs rotate NeoX-style in both, unpermuted). An MoE GGUF's fused expert tensors
(`blk.{i}.ffn_gate_exps` [E, m, d], ...) read as each expert's own Hugging Face tensor
(`model.layers.{i}.mlp.experts.{e}.gate_proj.weight` [m, d]): a range of the fused tensor's rows; an older Mixtral
file's per-expert tensors (`blk.{i}.ffn_gate.{e}`) as that expert's. The names and metadata are mapped in
flashllm_ext.io.gguf_layout.
"""

from __future__ import annotations

import json
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from flashllm_ext.errors import FormatError
from flashllm_ext.io.paths import regular_file
from flashllm_ext.io.gguf_layout import (
    BLOCK_NAMES,
    DEQUANTIZE_CHUNK_BYTES,
    MOE_FAMILIES,
    READER_ERRORS,
    config_from_reader,
    expected_shapes,
    expert_parts,
    hf_name,
    open_reader,
    undo_rotary_permutation,
)
from flashllm_ext.io.safetensors import TensorEntry, dtype_name, read_header


def unsupported_model(model_type: object, found: str) -> FormatError:
    """The error for a checkpoint whose tensors are not named as those of a supported family (Llama, Mistral,
    SmolLM, OPT: decoder layers `layers.{i}`): it names the config's model_type, which says more than the names."""
    return FormatError("model_type", f"{model_type!r} is not supported: {found}")


class Checkpoint(ABC):
    """A checkpoint's config and tensors under Hugging Face names, each read only when asked for."""

    config: dict[str, Any]
    names: list[str]

    @abstractmethod
    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name`, from the header (nothing is read)."""

    @abstractmethod
    def dtype(self, name: str) -> str:
        """The safetensors dtype name ("F16", "I64", ...) `ckpt[name]` returns, from the header."""

    @abstractmethod
    def __getitem__(self, name: str) -> torch.Tensor:
        """Tensor `name`, read (GGUF: dequantized to fp32) now; nothing of it is kept."""

    def source_type(self, name: str) -> str:
        """The type tensor `name` has in the file: a safetensors dtype ("F16", "BF16", ...) or a GGUF type ("Q4_0",
        "Q6_K", "F16", ...)."""
        return self.dtype(name)

    def row_chunks(self, name: str, max_bytes: int) -> Iterator[torch.Tensor]:
        """Tensor `name` as `ckpt[name]` gives it, in consecutive blocks of rows (first dimension) of about
        `max_bytes` in fp32 each (at least one row, or one attention head's rows where a block must hold whole
        heads); a 1-D tensor comes whole. Only the rows of a block are read, where the format allows."""
        shape = self.shape(name)
        if len(shape) < 2:
            yield self[name]
            return
        unit = self._row_unit(name)
        step = max(1, max_bytes // (4 * math.prod(shape[1:]) * unit)) * unit
        for start in range(0, shape[0], step):
            yield self._rows(name, start, min(start + step, shape[0]))

    def _rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor `name`; formats that can read part of a tensor override this."""
        return self[name][start:stop]

    def _row_unit(self, name: str) -> int:
        """The rows a block of `row_chunks` is a multiple of."""
        return 1


class TensorsCheckpoint(Checkpoint):
    """Tensors already in memory (a loaded model's state_dict, pruned weights) as a Checkpoint, so the store
    writers take them like a file."""

    def __init__(self, config: dict[str, Any], tensors: dict[str, torch.Tensor]):
        self.config, self._tensors, self.names = dict(config), dict(tensors), list(tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def dtype(self, name: str) -> str:
        return dtype_name(self._tensors[name].dtype)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """A Hugging Face safetensors directory (sharded or not) or a Llama .gguf file."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return GGUFCheckpoint(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: expected a Hugging Face safetensors directory or a .gguf file")
    return SafetensorsCheckpoint(path)


def _read_json(path: Path) -> dict:
    """A checkpoint's JSON object; anything else raises FormatError naming the file."""
    try:
        parsed = json.loads(Path(regular_file(path)).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(path.name, f"not readable JSON ({e})", str(path)) from e
    if not isinstance(parsed, dict):
        raise FormatError(path.name, "must be a JSON object", str(path))
    return parsed


def _shard_path(path: Path, index: Path, name: str, shard: object) -> Path:
    """The shard `index` names for tensor `name`, which must lie inside the checkpoint folder: a relative path
    without "..". Checked on the name, not resolved: Hugging Face cache folders hold symbolic links to blobs kept
    outside them."""
    if not isinstance(shard, str) or Path(shard).is_absolute() or ".." in Path(shard).parts:
        raise FormatError(f"weight_map[{name!r}]", f"shard {shard!r} is outside the checkpoint folder", str(index))
    return path / shard


class SafetensorsCheckpoint(Checkpoint):
    """A Hugging Face directory: config.json and one or more safetensors shards (model.safetensors.index.json)."""

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        config_path = path / "config.json"
        if not config_path.exists():
            raise FormatError("config.json", "missing", str(path))
        self.config = _read_json(config_path)
        self._shard_of, self._entries = self._index(path)
        self.names = list(self._shard_of)
        self._handles: dict[Path, Any] = {}  # shard -> open safe_open handle

    @staticmethod
    def _index(path: Path) -> tuple[dict[str, Path], dict[str, TensorEntry]]:
        """(tensor name -> shard, tensor name -> header entry), every shard header validated before any data is read."""
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise FormatError("weight_map", "missing or not an object", str(index))
            shards = {_shard_path(path, index, name, f) for name, f in weight_map.items()}
        else:
            shards = set(path.glob("*.safetensors"))
        if not shards:
            raise FormatError("model.safetensors", "no safetensors file in the checkpoint", str(path))
        shard_of: dict[str, Path] = {}
        entries: dict[str, TensorEntry] = {}
        for shard in sorted(shards):
            for name, entry in read_header(shard).tensors.items():
                shard_of[name], entries[name] = shard, entry
        return shard_of, entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def dtype(self, name: str) -> str:
        return self._entries[name].dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def _rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._handle(name).get_slice(name)[start:stop]

    def _handle(self, name: str) -> Any:
        shard = self._shard_of[name]
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(shard), framework="pt")
        return self._handles[shard]


class GGUFCheckpoint(Checkpoint):
    """A Llama, Mixtral, OLMoE, Qwen2-MoE or Qwen3-MoE GGUF file under Hugging Face names. Opening validates the header
    (architecture, every tensor's name and shape, none missing); `ckpt[name]` dequantizes that one tensor to fp32
    (Q/K rows un-permuted). Tensor data is read with pread into memory of its own, never through the reader's map of
    the file: pages of a mapped file that were read stay in the process (resident, counted by a memory cgroup) until
    it unmaps them, so a converter reading a 4.5 GB file through the map would hold 4.5 GB. Raises FormatError naming
    the file and the field."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        reader = open_reader(self.path)
        self.config = config_from_reader(reader, self.path)
        shapes = expected_shapes(self.config)
        family = MOE_FAMILIES.get(self.config["model_type"])
        # Hugging Face name -> gguf ReaderTensor: its offset, size and type (its data, the map, is not read); and
        # the first row of the tensor's data where the name is one expert's part of a fused tensor.
        self._tensors: dict[str, Any] = {}
        self._first_row: dict[str, int] = {}
        for tensor in reader.tensors:
            shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first
            parts = None if family is None else expert_parts(tensor.name, shape, family)
            if parts is None:
                parts = [(hf_name(tensor.name, BLOCK_NAMES if family is None else family.block_names()), shape, 0)]
            for name, part_shape, first_row in parts:
                if name is None or name not in shapes:
                    raise FormatError(tensor.name, "tensor has no place in the layout of this config", self.path)
                if part_shape != shapes[name]:
                    raise FormatError(tensor.name, f"shape {part_shape}, expected {shapes[name]} for {name}", self.path)
                self._tensors[name], self._first_row[name] = tensor, first_row
        missing = [name for name in shapes if name not in self._tensors]
        if missing:
            raise FormatError(missing[0], f"missing tensor ({len(missing)} missing in all)", self.path)
        self.names = list(self._tensors)
        self._shapes = shapes

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype(self, name: str) -> str:
        return "F32"  # every tensor is dequantized to fp32

    def source_type(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self._shapes[name]
        if len(shape) < 2:
            return self._rows(name, 0, shape[0])
        # Filled a block of rows at a time: the dequantizers' temporaries stay those of one block.
        weight = torch.empty(shape, dtype=torch.float32)
        row = 0
        for chunk in self.row_chunks(name, DEQUANTIZE_CHUNK_BYTES):
            weight[row : row + len(chunk)] = chunk
            row += len(chunk)
        return weight

    def raw_blocks(self, name: str) -> tuple[torch.Tensor, str]:
        """Tensor `name`'s rows as the file stores them, not dequantized: uint8 [rows, row_bytes] (a quantized
        type's blocks of each row, a float type's bytes) and the GGUF type's name ("Q4_0", "Q6_K", "F16", ...).
        q_proj and k_proj rows, stored in llama.cpp's rotary order, come back in the Hugging Face order (a row
        permutation: each row's blocks are unchanged)."""
        tensor = self._tensors[name]
        rows, row_bytes = math.prod(self._shapes[name][:-1]), self._row_bytes(name)
        data = self._read(tensor, self._first_row[name] * row_bytes, rows * row_bytes)
        blocks = torch.frombuffer(data, dtype=torch.uint8).view(rows, -1)
        heads = self._rotary_heads(name)
        if heads:
            blocks = undo_rotary_permutation(blocks, heads).contiguous()
        return blocks, tensor.tensor_type.name

    def _rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        import gguf

        tensor = self._tensors[name]
        shape = self._shapes[name]
        # tensor.data is the reader's map of the file: its dtype and shape are header values, nothing is read.
        if len(shape) > 1:
            row_bytes = self._row_bytes(name)
            data = self._read(tensor, (self._first_row[name] + start) * row_bytes, (stop - start) * row_bytes)
            layout, expected = (stop - start, *tensor.data.shape[-1:]), (stop - start, *shape[1:])
        else:  # 1-D: read whole (__getitem__ asks for no less)
            data = self._read(tensor, 0, tensor.n_bytes)
            layout, expected = tensor.data.shape, shape
        try:
            array = gguf.quants.dequantize(
                np.frombuffer(data, dtype=tensor.data.dtype).reshape(layout), tensor.tensor_type
            )
        except (*READER_ERRORS, NotImplementedError) as e:
            raise FormatError(
                tensor.name, f"cannot dequantize {tensor.tensor_type.name} data ({e})", self.path
            ) from None
        if tuple(array.shape) != expected:
            raise FormatError(
                tensor.name, f"dequantized to shape {tuple(array.shape)}, expected {expected} for {name}", self.path
            )
        if array.dtype != np.float32 or not array.flags.writeable:
            array = array.astype(np.float32)
        weight = torch.from_numpy(array)
        heads = self._rotary_heads(name)
        if heads:  # a block holds whole heads (_row_unit), each un-permuted on its own
            weight = undo_rotary_permutation(weight, heads * (stop - start) // shape[0])
        return weight

    def _row_bytes(self, name: str) -> int:
        """Bytes of one row of tensor `name` in the file (of its fused tensor: an expert's rows are some of them)."""
        tensor = self._tensors[name]
        return tensor.n_bytes // math.prod(int(n) for n in tensor.shape[1:])

    def _row_unit(self, name: str) -> int:
        heads = self._rotary_heads(name)
        return self._shapes[name][0] // heads if heads else 1

    def _rotary_heads(self, name: str) -> int | None:
        """The head count of a Llama's or Mixtral's q_proj or k_proj weight (its rows are in llama.cpp's rotary
        order), None otherwise (OLMoE's and Qwen3-MoE's rows are in the Hugging Face order)."""
        if self.config["model_type"] not in ("llama", "mixtral"):
            return None
        if name.endswith("self_attn.q_proj.weight"):
            return self.config["num_attention_heads"]
        if name.endswith("self_attn.k_proj.weight"):
            return self.config["num_key_value_heads"]
        return None

    def _read(self, tensor: Any, offset: int, size: int) -> bytearray:
        """`size` bytes of `tensor`'s data from `offset` on, read into memory of its own."""
        data = bytearray(size)
        view = memoryview(data)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            done = 0
            while done < size:
                n = os.preadv(fd, [view[done:]], tensor.data_offset + offset + done)
                if n == 0:
                    raise FormatError(tensor.name, f"data ends {size - done} bytes early (file truncated?)", self.path)
                done += n
        finally:
            os.close(fd)
        return data


def load_gguf(path: str | os.PathLike, progress: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of a Llama GGUF dequantized to fp32 under its Hugging Face name, Q/K rows un-permuted (the whole
    model in memory: for reference comparisons; conversion reads a GGUFCheckpoint one tensor at a time).

    Raises FormatError (naming the file and the field) for a non-GGUF file, an unsupported architecture,
    unknown, missing or wrongly shaped tensors.
    """
    ckpt = GGUFCheckpoint(path)
    return {
        name: ckpt[name]
        for name in tqdm(ckpt.names, desc=f"dequantizing {Path(path).name}", disable=not progress, unit="t")
    }
