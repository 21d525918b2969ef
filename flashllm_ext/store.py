"""The flash weight store: FFN weights bundled per neuron on disk, everything else resident in DRAM.

A store is a directory with two safetensors files (DESIGN.md §5):
  bundles.safetensors   per layer `layers.{l}.bundles` [n_neurons, bundle_width], bundle = [up_col | gate_col | down_row]
                        (gate only for GLU models), each tensor on an `alignment`-byte boundary of the file so that
                        neuron i of layer l is one contiguous, direct-I/O-friendly range. With Endor compression the
                        layer is stored as `layers.{l}.bundles.values/.bitmap/.row_offsets` (row = neuron).
  resident.safetensors  embeddings, attention, norms, biases: what stays in memory.
Both headers carry `magic` and `format_version`; bundles.safetensors also the model config, dtype, widths and
alignment. `convert` writes a store, `FlashStore` opens and validates one.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import endor
from .errors import FormatError
from .safetensors_io import AlignedWriter, TensorSpec, dtype_name, read_header

if TYPE_CHECKING:
    from .reader import FlashReader

MAGIC = "flashllm-store"
FORMAT_VERSION = "1"
ALIGNMENT = 4096
BUNDLES_FILE = "bundles.safetensors"
RESIDENT_FILE = "resident.safetensors"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# FFN weight names of the supported families: Llama/Mistral/SmolLM (gate/up/down) and OPT (fc1/fc2).
_FFN_NAME = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(?:mlp\.)?(gate_proj|up_proj|down_proj|fc1|fc2)\.weight$")
_ROLE = {"gate_proj": "gate", "up_proj": "up", "fc1": "up", "down_proj": "down", "fc2": "down"}
_VERIFY_SAMPLES = 4  # neurons per layer read back after writing


def layer_tensor_name(layer: int) -> str:
    return f"layers.{layer}.bundles"


# ----------------------------------------------------------------------------------------------- checkpoints
def _read_json(path: Path) -> dict:
    """A checkpoint's JSON object; anything else raises FormatError naming the file."""
    try:
        parsed = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(path.name, f"not readable JSON ({e})", str(path)) from e
    if not isinstance(parsed, dict):
        raise FormatError(path.name, "must be a JSON object", str(path))
    return parsed


class _Checkpoint:
    """Uniform lazy access to the tensors of an HF safetensors directory (sharded or not) or a GGUF file."""

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        if path.is_file() and path.suffix == ".gguf":
            from .models import gguf_config, load_gguf  # the GGUF reader lives with the model definitions

            self.config = dict(gguf_config(path))
            loaded = load_gguf(path)
            self.names = list(loaded)
            self._get: Callable[[str], torch.Tensor] = loaded.__getitem__
            return
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: expected a Hugging Face safetensors directory or a .gguf file")
        config_path = path / "config.json"
        if not config_path.is_file():
            raise FormatError("config.json", "missing", str(path))
        self.config = _read_json(config_path)
        shard_of = self._shard_map(path)
        self.names = list(shard_of)
        handles: dict[Path, object] = {}

        def get(name: str) -> torch.Tensor:
            shard = shard_of[name]
            if shard not in handles:
                handles[shard] = safe_open(str(shard), framework="pt")
            return handles[shard].get_tensor(name)

        self._get = get

    @staticmethod
    def _shard_map(path: Path) -> dict[str, Path]:
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise FormatError("weight_map", "missing or not an object", str(index))
            shards = {path / f for f in set(weight_map.values())}
        else:
            shards = set(path.glob("*.safetensors"))
        if not shards:
            raise FormatError("model.safetensors", "no safetensors file in the checkpoint", str(path))
        shard_of: dict[str, Path] = {}
        for shard in sorted(shards):
            for name in read_header(shard).tensors:  # validates every shard header before any data is read
                shard_of[name] = shard
        return shard_of

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._get(name)


def _ffn_layout(names: list[str]) -> tuple[dict[int, dict[str, str]], bool]:
    """Per layer in layer order, the tensor names of its up/gate/down weights; and whether the model is gated (GLU)."""
    layers: dict[int, dict[str, str]] = {}
    for name in names:
        m = _FFN_NAME.match(name)
        if m:
            layers.setdefault(int(m.group(1)), {})[_ROLE[m.group(2)]] = name
    if not layers or sorted(layers) != list(range(len(layers))):
        raise FormatError("layers", f"no FFN weights or non-contiguous layer numbers {sorted(layers)[:8]}")
    # Numeric order: tensor names sort as strings (layers.10 before layers.2), and the header's declaration order
    # must be the order the layers are written in.
    layers = dict(sorted(layers.items()))
    glu = "gate" in layers[0]
    for layer, roles in layers.items():
        needed = {"up", "down"} | ({"gate"} if glu else set())
        if set(roles) != needed:
            raise FormatError(f"layers.{layer}", f"FFN weights {sorted(roles)}, expected {sorted(needed)}")
    return layers, glu


def bundle_layer(up: torch.Tensor, down: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Row-column bundling of one FFN layer.

    up, gate: nn.Linear weights [ffn, d] (neuron i's input column is row i); down: [d, ffn] (its output row is
    column i). Returns [ffn, bundle_width] with row i = [up[i] | gate[i] | down[:, i]], bundle_width = 2d or 3d.
    """
    parts = [up] + ([gate] if gate is not None else []) + [down.t()]
    ffn = up.shape[0]
    if any(p.dim() != 2 or p.shape[0] != ffn for p in parts):
        raise ValueError(f"FFN shapes disagree: up {tuple(up.shape)}, down {tuple(down.shape)}, "
                         f"gate {None if gate is None else tuple(gate.shape)}")
    return torch.cat(parts, dim=1).contiguous()


# ----------------------------------------------------------------------------------------------- convert
def convert(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "fp16", endor: bool = False,
            force: bool = False, progress: bool = True) -> Path:
    """Convert a Hugging Face safetensors directory (OPT, Llama/Mistral/SmolLM; sharded or not) or a GGUF file
    into a flash store at `out_dir`. Atomic: written under a temporary name and renamed at the end, then a sample
    of every layer is read back and compared. Refuses to replace an existing `out_dir` unless `force`.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not force:
        raise FileExistsError(f"{out_dir} exists; pass force=True (--force) to replace it")
    ckpt = _Checkpoint(checkpoint)
    layers, glu = _ffn_layout(ckpt.names)
    torch_dtype = DTYPES[dtype]
    first = layers[0]
    ffn, hidden = (int(s) for s in ckpt[first["up"]].shape)
    width = (3 if glu else 2) * hidden
    metadata = _bundles_metadata(ckpt.config, dtype, len(layers), ffn, hidden, glu, endor)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        expected = _write_bundles(tmp / BUNDLES_FILE, ckpt, layers, torch_dtype, endor, ffn, width, metadata,
                                  progress)
        ffn_names = {n for roles in layers.values() for n in roles.values()}
        resident = {n: _to_store_dtype(ckpt[n], torch_dtype).contiguous() for n in ckpt.names if n not in ffn_names}
        save_file(resident, str(tmp / RESIDENT_FILE),
                  metadata={"magic": MAGIC, "format_version": FORMAT_VERSION, "dtype": dtype})
        _verify(FlashStore(tmp), expected, resident)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old)
        else:
            tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out_dir


def _to_store_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A resident tensor in the store's float dtype if it is a float tensor. Integer and bool buffers (position ids,
    index tables, masks) keep their dtype: a float cast would change what they mean and lose values (fp16 holds
    integers exactly only up to 2048)."""
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _bundles_metadata(config: dict, dtype: str, n_layers: int, n_neurons: int, hidden: int, glu: bool,
                      use_endor: bool) -> dict[str, str]:
    width = (3 if glu else 2) * hidden
    return {"magic": MAGIC, "format_version": FORMAT_VERSION, "config": json.dumps(config), "dtype": dtype,
            "bundle_width": str(width), "n_layers": str(n_layers), "n_neurons": str(n_neurons),
            "hidden_size": str(hidden), "glu": str(int(glu)), "alignment": str(ALIGNMENT),
            "endor": str(int(use_endor))}


def synthesize(out_dir: str | os.PathLike, n_layers: int, hidden_size: int, n_neurons: int, glu: bool = False,
               dtype: str = "fp16", seed: int = 0) -> Path:
    """A store of random weights with a real model's FFN shapes (e.g. OPT-6.7B: hidden 4096, 16384 neurons), for
    I/O benchmarks at a scale no checkpoint here has. No resident tensors. Written one layer at a time."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch_dtype = DTYPES[dtype]
    width = (3 if glu else 2) * hidden_size
    config = {"model_type": "synthetic", "hidden_size": hidden_size, "intermediate_size": n_neurons,
              "num_hidden_layers": n_layers}
    specs = [spec for layer in range(n_layers) for spec in _layer_specs(layer, n_neurons, width, torch_dtype, None)]
    generator = torch.Generator().manual_seed(seed)
    metadata = _bundles_metadata(config, dtype, n_layers, n_neurons, hidden_size, glu, False)
    with AlignedWriter(out_dir / BUNDLES_FILE, specs, metadata, ALIGNMENT) as writer:
        for layer in range(n_layers):
            writer.write(layer_tensor_name(layer),
                         torch.randn((n_neurons, width), generator=generator, dtype=torch.float32).to(torch_dtype))
    save_file({}, str(out_dir / RESIDENT_FILE), metadata={"magic": MAGIC, "format_version": FORMAT_VERSION,
                                                           "dtype": dtype})
    return out_dir


def _layer_specs(layer: int, ffn: int, width: int, dtype: torch.dtype, endor_nnz: int | None) -> list[TensorSpec]:
    name = layer_tensor_name(layer)
    if endor_nnz is None:
        return [TensorSpec(name, dtype_name(dtype), (ffn, width))]
    return [TensorSpec(f"{name}.values", dtype_name(dtype), (endor_nnz,)),
            TensorSpec(f"{name}.bitmap", "U8", (ffn, (width + 7) // 8)),
            TensorSpec(f"{name}.row_offsets", "I64", (ffn + 1,))]


def _write_bundles(path: Path, ckpt: _Checkpoint, layers: dict[int, dict[str, str]], dtype: torch.dtype,
                   use_endor: bool, ffn: int, width: int, metadata: dict[str, str],
                   progress: bool) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Writes every layer; returns per layer (sample neuron ids, their expected bundles) for verification."""
    from tqdm.auto import tqdm

    def bundles(layer: int) -> torch.Tensor:
        roles = layers[layer]
        gate = ckpt[roles["gate"]].to(dtype) if "gate" in roles else None
        return bundle_layer(ckpt[roles["up"]].to(dtype), ckpt[roles["down"]].to(dtype), gate)

    # Endor sizes are only known after compressing, and the header (written first) needs them: compress every
    # layer up front. Endor stores are for pruned models, whose compressed layers are small.
    compressed = {l: endor.compress(bundles(l)) for l in layers} if use_endor else {}
    specs = [s for l in layers for s in _layer_specs(l, ffn, width, dtype,
                                                     compressed[l].values.numel() if use_endor else None)]
    expected = {}
    generator = torch.Generator().manual_seed(0)
    with AlignedWriter(path, specs, metadata, ALIGNMENT) as writer:
        for layer in tqdm(layers, desc="bundling FFN layers", unit="layer", disable=not progress):
            ids = torch.cat([torch.tensor([0, ffn - 1]), torch.randint(0, ffn, (_VERIFY_SAMPLES - 2,),
                                                                       generator=generator)])
            name = layer_tensor_name(layer)
            if use_endor:
                t = compressed.pop(layer)
                for part in endor.PARTS:
                    writer.write(f"{name}.{part}", getattr(t, part))
                expected[layer] = (ids, t.decompress(ids))
            else:
                layer_bundles = bundles(layer)
                if tuple(layer_bundles.shape) != (ffn, width):
                    raise FormatError(name, f"shape {tuple(layer_bundles.shape)} differs from layer 0's {(ffn, width)}")
                writer.write(name, layer_bundles)
                expected[layer] = (ids, layer_bundles[ids].clone())
    return expected


def _verify(store: FlashStore, expected: dict[int, tuple[torch.Tensor, torch.Tensor]],
            resident: dict[str, torch.Tensor]) -> None:
    for layer, (ids, want) in expected.items():
        if not torch.equal(store.bundle(layer, ids).view(torch.uint8), want.view(torch.uint8)):
            raise RuntimeError(f"{store.path}: read-back of layer {layer} neurons {ids.tolist()} differs from "
                               "what was written")
    if resident:
        name = next(iter(resident))
        if not torch.equal(store.resident_tensor(name), resident[name]):
            raise RuntimeError(f"{store.path}: read-back of resident tensor {name} differs from what was written")


# ----------------------------------------------------------------------------------------------- FlashStore
@dataclass(frozen=True)
class LayerLocation:
    """Where a layer's bundles lie in bundles.safetensors (absolute byte offsets), for the native reader."""
    offset: int
    row_bytes: int
    n_neurons: int


class FlashStore:
    """An opened, validated flash store. Raises FormatError naming file and field on any inconsistency.

    `reader()` is the store's one FlashReader, shared by every NeuronCache over it; `close()` (or leaving a `with`
    block) shuts it down.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.bundles_path = str(self.path / BUNDLES_FILE)
        self.resident_path = str(self.path / RESIDENT_FILE)
        header = read_header(self.bundles_path)
        meta = header.metadata
        self._check_magic(meta, self.bundles_path)
        self._check_magic(read_header(self.resident_path).metadata, self.resident_path)
        self.dtype_name = meta.get("dtype")
        if self.dtype_name not in DTYPES:
            raise FormatError("__metadata__.dtype", f"must be one of {sorted(DTYPES)}, got {self.dtype_name!r}",
                              self.bundles_path)
        self.dtype = DTYPES[self.dtype_name]
        ints = {key: self._int_field(meta, key) for key in
                ("bundle_width", "n_layers", "n_neurons", "hidden_size", "glu", "alignment", "endor")}
        self.bundle_width, self.n_layers, self.n_neurons = ints["bundle_width"], ints["n_layers"], ints["n_neurons"]
        self.hidden_size, self.glu, self.alignment = ints["hidden_size"], bool(ints["glu"]), ints["alignment"]
        self.endor = bool(ints["endor"])
        if self.alignment & (self.alignment - 1) or self.alignment < 512:
            raise FormatError("__metadata__.alignment", f"must be a power of two >= 512, got {self.alignment}",
                              self.bundles_path)
        if self.bundle_width != (3 if self.glu else 2) * self.hidden_size:
            raise FormatError("__metadata__.bundle_width", f"{self.bundle_width} disagrees with hidden_size "
                              f"{self.hidden_size} and glu={self.glu}", self.bundles_path)
        try:
            self.config: dict = json.loads(meta.get("config", ""))
        except json.JSONDecodeError as e:
            raise FormatError("__metadata__.config", f"not JSON ({e})", self.bundles_path) from None
        self.row_bytes = self.bundle_width * self.dtype.itemsize
        self._entries = header.tensors
        self._endor_index: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(self.n_layers):
            for spec in _layer_specs(layer, self.n_neurons, self.bundle_width, self.dtype, -1 if self.endor else None):
                self._check_entry(spec)
        self._reader: FlashReader | None = None
        self._reader_lock = threading.Lock()

    def reader(self) -> FlashReader:
        """The store's shared FlashReader (default settings), opened on first use. One per store: each reader owns a
        pool of worker threads and a file descriptor, so a cache per layer must not each start its own; concurrent
        calls are safe and each returns its own stats."""
        with self._reader_lock:
            if self._reader is None:
                from .reader import FlashReader  # reader.py imports this module

                self._reader = FlashReader(self)
            return self._reader

    def close(self) -> None:
        """Closes the shared reader (its threads and file descriptor) if one was opened; reader() opens a new one."""
        with self._reader_lock:
            reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()

    def __enter__(self) -> FlashStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_magic(self, meta: dict[str, str], path: str) -> None:
        if meta.get("magic") != MAGIC:
            raise FormatError("__metadata__.magic", f"expected {MAGIC!r}, got {meta.get('magic')!r}", path)
        if meta.get("format_version") != FORMAT_VERSION:
            raise FormatError("__metadata__.format_version",
                              f"unsupported version {meta.get('format_version')!r} (this library reads "
                              f"{FORMAT_VERSION})", path)

    def _int_field(self, meta: dict[str, str], key: str) -> int:
        try:
            value = int(meta[key])
        except (KeyError, ValueError):
            raise FormatError(f"__metadata__.{key}", f"missing or not an integer: {meta.get(key)!r}",
                              self.bundles_path) from None
        if value < 0:
            raise FormatError(f"__metadata__.{key}", f"must be non-negative, got {value}", self.bundles_path)
        return value

    def _check_entry(self, spec: TensorSpec) -> None:
        entry = self._entries.get(spec.name)
        if entry is None:
            raise FormatError(spec.name, "missing", self.bundles_path)
        # Endor values have a data-dependent length (declared as -1 here); everything else is fixed by metadata.
        shape_ok = len(entry.shape) == 1 if spec.shape == (-1,) else entry.shape == spec.shape
        if entry.dtype != spec.dtype or not shape_ok:
            raise FormatError(f"{spec.name}.shape", f"{entry.dtype}{list(entry.shape)}, expected "
                              f"{spec.dtype}{list(spec.shape)}", self.bundles_path)
        if entry.begin % self.alignment:
            raise FormatError(f"{spec.name}.data_offsets", f"starts at byte {entry.begin}, not a multiple of the "
                              f"{self.alignment}-byte alignment", self.bundles_path)

    def layer_location(self, layer: int) -> LayerLocation:
        """Absolute file offset and row size of a dense layer, for FlashReader."""
        self._check_layer(layer)
        if self.endor:
            raise ValueError(f"{self.bundles_path}: Endor stores have variable-size bundles; use bundle()")
        entry = self._entries[layer_tensor_name(layer)]
        return LayerLocation(entry.begin, self.row_bytes, self.n_neurons)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.n_layers})")

    def check_ids(self, ids: torch.Tensor | list[int]) -> torch.Tensor:
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.n_neurons):
            raise ValueError(f"neuron ids must lie in [0, {self.n_neurons}), got min {int(ids.min())} "
                             f"max {int(ids.max())}")
        return ids

    def bundle(self, layer: int, ids: torch.Tensor | list[int]) -> torch.Tensor:
        """Bundles of neurons `ids` (any order, repeats allowed) of `layer`: [len(ids), bundle_width] of self.dtype.

        Plain buffered reads (os.pread, one per run of consecutive neurons); FlashReader is the fast path.
        """
        self._check_layer(layer)
        ids = self.check_ids(ids)
        unique, inverse = torch.unique(ids, return_inverse=True)
        if self.endor:
            rows = self._endor_rows(layer, unique)
        else:
            entry = self._entries[layer_tensor_name(layer)]
            rows = self._read_runs(unique, lambda a, b: (entry.begin + a * self.row_bytes,
                                                         entry.begin + b * self.row_bytes))
            rows = rows.view(self.dtype).view(-1, self.bundle_width)
        return rows[inverse]

    def _read_runs(self, sorted_ids: torch.Tensor, span: Callable[[int, int], tuple[int, int]]) -> torch.Tensor:
        """Concatenated bytes of span(a, b) for each run a..b-1 of consecutive ids, as uint8."""
        chunks = []
        with open(self.bundles_path, "rb", buffering=0) as f:
            for a, b in _runs(sorted_ids.tolist()):
                begin, end = span(a, b)
                data = os.pread(f.fileno(), end - begin, begin)
                if len(data) != end - begin:
                    raise FormatError("data", f"short read at offset {begin}: {len(data)} of {end - begin} bytes "
                                      "(file truncated?)", self.bundles_path)
                chunks.append(data)
        return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8) if chunks else \
            torch.empty(0, dtype=torch.uint8)

    def _endor_rows(self, layer: int, sorted_ids: torch.Tensor) -> torch.Tensor:
        bitmap, row_offsets = self._endor_layer_index(layer)
        values_entry = self._entries[f"{layer_tensor_name(layer)}.values"]
        item = self.dtype.itemsize
        values = self._read_runs(sorted_ids, lambda a, b: (values_entry.begin + int(row_offsets[a]) * item,
                                                           values_entry.begin + int(row_offsets[b]) * item))
        counts = row_offsets[sorted_ids + 1] - row_offsets[sorted_ids]
        offsets = torch.zeros(sorted_ids.numel() + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=offsets[1:])
        subset = endor.EndorTensor(values.view(self.dtype), bitmap[sorted_ids], offsets,
                                   (sorted_ids.numel(), self.bundle_width), source=self.bundles_path)
        return subset.decompress()

    def _endor_layer_index(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Bitmap and row offsets of an Endor layer (small: kept in memory once read and validated)."""
        if layer not in self._endor_index:
            name = layer_tensor_name(layer)
            with safe_open(self.bundles_path, framework="pt") as f:
                bitmap, row_offsets = f.get_tensor(f"{name}.bitmap"), f.get_tensor(f"{name}.row_offsets")
            nnz = self._entries[f"{name}.values"].shape[0]
            counts = row_offsets.diff()
            if int(row_offsets[0]) != 0 or int(row_offsets[-1]) != nnz or bool((counts < 0).any()):
                raise FormatError(f"{name}.row_offsets", f"must rise from 0 to the {nnz} values", self.bundles_path)
            self._endor_index[layer] = (bitmap, row_offsets)
        return self._endor_index[layer]

    def resident(self) -> dict[str, torch.Tensor]:
        """Every resident tensor (embeddings, attention, norms, biases) under its checkpoint name."""
        from safetensors.torch import load_file

        return load_file(self.resident_path)

    def resident_tensor(self, name: str) -> torch.Tensor:
        with safe_open(self.resident_path, framework="pt") as f:
            return f.get_tensor(name)

    def __repr__(self) -> str:
        return (f"FlashStore({str(self.path)!r}, layers={self.n_layers}, neurons={self.n_neurons}, "
                f"bundle_width={self.bundle_width}, dtype={self.dtype_name}, glu={self.glu}, endor={self.endor})")


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
