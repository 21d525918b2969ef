"""Endor: pruned weights stored as their non-zero values plus a 1-bit-per-element bitmap.

Layout (docs/design.md §5), the sparse-bitmask layout of `compressed-tensors` plus a final row offset:
  values       [nnz]                 non-zeros in row-major order, dtype of the weight
  bitmap       uint8 [rows, ceil(cols/8)], each row starts on a byte; bit j of byte b is column 8*b + j
  row_offsets  int64 [rows + 1]      start of each row in `values`; the last entry is nnz

"Non-zero" means a non-zero bit pattern, so -0.0 and NaN payloads survive a round trip bit for bit.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from flashllm_ext import ops
from flashllm_ext.ops.bits import BITS_VIEW, pack_bitmap
from flashllm_ext.errors import FormatError
from flashllm_ext.io.safetensors import read_header, save_tensors

FORMAT_NAME = "flashllm-endor"
FORMAT_VERSION = "1"
PARTS = ("values", "bitmap", "row_offsets")
_DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in ops.ENDOR_DTYPES}


class EndorTensor:
    """A 2-D weight in Endor form. Construction validates the arrays (FormatError on any inconsistency)."""

    def __init__(
        self,
        values: torch.Tensor,
        bitmap: torch.Tensor,
        row_offsets: torch.Tensor,
        shape: tuple[int, int],
        *,
        source: str | None = None,
        validate: bool = True,
    ):
        self.values, self.bitmap, self.row_offsets = values, bitmap, row_offsets
        self.shape = (int(shape[0]), int(shape[1]))
        if validate:
            self._validate(source)

    def _validate(self, source: str | None) -> None:
        rows, cols = self.shape
        fields = (
            ("values", self.values, 1, ops.ENDOR_DTYPES),
            ("bitmap", self.bitmap, 2, (torch.uint8,)),
            ("row_offsets", self.row_offsets, 1, (torch.int64,)),
        )
        for name, t, ndim, dtypes in fields:
            if not isinstance(t, torch.Tensor) or t.dim() != ndim or t.dtype not in dtypes:
                raise FormatError(
                    name,
                    f"must be a {ndim}-D tensor of {dtypes}, got "
                    f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}",
                    source,
                )
        if rows < 0 or cols < 0:
            raise FormatError("shape", f"must be non-negative, got {self.shape}", source)
        if tuple(self.bitmap.shape) != (rows, (cols + 7) // 8):
            raise FormatError(
                "bitmap",
                f"shape {tuple(self.bitmap.shape)} does not match weight shape "
                f"{self.shape} (needs {(rows, (cols + 7) // 8)})",
                source,
            )
        if self.row_offsets.numel() != rows + 1:
            raise FormatError("row_offsets", f"has {self.row_offsets.numel()} entries, needs rows+1={rows + 1}", source)
        try:
            ops.check_endor_args(self.values, self.bitmap, self.row_offsets, cols, None)
        except RuntimeError as e:
            raise FormatError("row_offsets", str(e).removeprefix("endor_decompress: "), source) from None

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def nbytes(self) -> int:
        """Bytes of the compressed form: values + bitmap + row offsets."""
        return sum(t.numel() * t.element_size() for t in (self.values, self.bitmap, self.row_offsets))

    @property
    def dense_nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.values.element_size()

    @property
    def density(self) -> float:
        return self.values.numel() / max(1, self.shape[0] * self.shape[1])

    def decompress(self, rows: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Dense rows: all of them, or `rows` (int64 [R], any order, repeats allowed) in that order.

        Returns [R, cols] of self.dtype, written into `out` when given (contiguous, same dtype and device).
        """
        if rows is not None:
            rows = torch.as_tensor(rows, dtype=torch.int64, device=self.device)
        return ops.endor_decompress(
            self.values, self.bitmap, self.row_offsets, n_cols=self.shape[1], rows=rows, out=out
        )

    def to(self, device: torch.device | str) -> EndorTensor:
        # Already validated: checking again on the target device would cost a synchronising pass.
        return EndorTensor(
            self.values.to(device), self.bitmap.to(device), self.row_offsets.to(device), self.shape, validate=False
        )

    def __repr__(self) -> str:
        return (
            f"EndorTensor(shape={self.shape}, dtype={self.dtype}, density={self.density:.3f}, "
            f"ratio={self.nbytes / max(1, self.dense_nbytes):.3f}, device={self.device})"
        )


def _nonzero_mask(w: torch.Tensor) -> torch.Tensor:
    """Which elements Endor stores: a non-zero bit pattern (so -0.0 and NaN payloads are kept)."""
    return w.contiguous().view(BITS_VIEW[w.dtype]) != 0


def count_nonzero(w: torch.Tensor) -> int:
    """The number of values `compress(w)` stores, without building them (sizes a file before writing it)."""
    return int(_nonzero_mask(w).sum())


def compress(w: torch.Tensor) -> EndorTensor:
    """Compress a 2-D fp32/fp16/bf16/int8 tensor (any layout, any sparsity pattern)."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"compress expects a 2-D tensor, got {getattr(w, 'shape', type(w))}")
    if w.dtype not in BITS_VIEW:
        raise ValueError(f"compress supports {tuple(BITS_VIEW)}, got {w.dtype}")
    w = w.contiguous()
    mask = _nonzero_mask(w)
    counts = mask.sum(dim=1)
    row_offsets = torch.zeros(w.shape[0] + 1, dtype=torch.int64, device=w.device)
    torch.cumsum(counts, 0, out=row_offsets[1:])
    return EndorTensor(w[mask], pack_bitmap(mask), row_offsets, tuple(w.shape))


def row_starts(row_offsets: torch.Tensor, bitmap_bytes: int, itemsize: int) -> torch.Tensor:
    """Byte offset of each row in the rows layout (`pack_rows`): row i = [bitmap row i | values of row i].
    row_offsets int64 [rows + 1] -> int64 [rows + 1]; the last entry is the layout's size."""
    return torch.arange(row_offsets.numel(), dtype=torch.int64) * bitmap_bytes + row_offsets.cpu() * itemsize


def pack_rows(t: EndorTensor) -> torch.Tensor:
    """The rows layout of a flash store's Endor layer: for each row, its bitmap bytes then its values, back to back,
    so one row (one neuron's bundle) is one contiguous read. Returns uint8 [row_starts(...)[-1]]."""
    bitmap = t.bitmap.cpu().contiguous().numpy()
    item = t.values.element_size()
    value_bytes = t.values.cpu().contiguous().view(torch.uint8).numpy()
    starts = row_starts(t.row_offsets, bitmap.shape[1], item).tolist()
    value_at = (t.row_offsets.cpu() * item).tolist()
    blob = torch.empty(starts[-1], dtype=torch.uint8)
    out, width = blob.numpy(), bitmap.shape[1]
    for i in range(t.shape[0]):
        out[starts[i] : starts[i] + width] = bitmap[i]
        out[starts[i] + width : starts[i + 1]] = value_bytes[value_at[i] : value_at[i + 1]]
    return blob


def unpack_rows(
    rows: torch.Tensor, counts: torch.Tensor, n_cols: int, dtype: torch.dtype, source: str | None = None
) -> EndorTensor:
    """The EndorTensor of rows in the rows layout read back to back: rows uint8 [total bytes], counts int64 [k]
    (values per row). Validated like any EndorTensor (FormatError naming `source`)."""
    width = (n_cols + 7) // 8
    item = torch.empty((), dtype=dtype).element_size()
    offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=offsets[1:])
    starts = row_starts(offsets, width, item)
    if rows.numel() != int(starts[-1]):
        raise FormatError("rows", f"{rows.numel()} bytes, the row counts need {int(starts[-1])}", source)
    heads = starts[:-1, None] + torch.arange(width)
    is_head = torch.zeros(rows.numel(), dtype=torch.bool)
    is_head[heads.reshape(-1)] = True
    bitmap = rows[heads.reshape(-1)].reshape(-1, width)
    values = rows[~is_head].view(dtype)
    return EndorTensor(values, bitmap, offsets, (counts.numel(), n_cols), source=source)


def to_compressed_tensors(t: EndorTensor) -> dict[str, torch.Tensor]:
    """The arrays of compressed-tensors' sparse-bitmask format: compressed, bitmask, shape, row_offsets."""
    return {
        "compressed": t.values,
        "bitmask": t.bitmap,
        "shape": torch.tensor(t.shape),
        "row_offsets": t.row_offsets[:-1],
    }


def from_compressed_tensors(
    compressed: torch.Tensor, bitmask: torch.Tensor, shape: torch.Tensor | tuple[int, int], row_offsets: torch.Tensor
) -> EndorTensor:
    """Build an EndorTensor from compressed-tensors' arrays (its row_offsets lack the final total)."""
    shape = tuple(int(s) for s in (shape.tolist() if isinstance(shape, torch.Tensor) else shape))
    if len(shape) != 2:
        raise FormatError("shape", f"must have two entries, got {shape}")
    total = torch.tensor([compressed.numel()], dtype=torch.int64, device=row_offsets.device)
    return EndorTensor(compressed, bitmask, torch.cat([row_offsets.to(torch.int64), total]), shape)


def save(path: str | os.PathLike, tensors: Mapping[str, EndorTensor | torch.Tensor]) -> None:
    """Write EndorTensors as `<name>.values/.bitmap/.row_offsets` (shape and dtype in the metadata) and plain
    tensors as `<name>`, into one safetensors file."""
    flat: dict[str, torch.Tensor] = {}
    metadata = {"format": FORMAT_NAME, "version": FORMAT_VERSION}
    for name, t in tensors.items():
        if isinstance(t, EndorTensor):
            keys = {part: f"{name}.{part}" for part in PARTS}
            for part, key in keys.items():
                flat[key] = getattr(t, part).detach().cpu().contiguous()
            metadata[f"endor.{name}"] = json.dumps({"shape": list(t.shape), "dtype": str(t.dtype)[6:]})
        elif isinstance(t, torch.Tensor):
            keys = {"": name}
            flat[name] = t.detach().cpu().contiguous()
        else:
            raise TypeError(f"{name}: expected EndorTensor or Tensor, got {type(t).__name__}")
    if len(flat) != sum(3 if isinstance(t, EndorTensor) else 1 for t in tensors.values()):
        raise ValueError("tensor names collide with the '<name>.values/.bitmap/.row_offsets' of an EndorTensor")
    save_tensors(flat, path, metadata)


def load(path: str | os.PathLike, device: torch.device | str = "cpu") -> dict[str, EndorTensor | torch.Tensor]:
    """Read a file written by `save`. Every field is validated; any inconsistency raises FormatError."""
    path = os.fspath(path)
    header = read_header(path)
    if header.metadata.get("format") != FORMAT_NAME:
        raise FormatError(
            "__metadata__.format", f"expected {FORMAT_NAME!r}, got {header.metadata.get('format')!r}", path
        )
    if header.metadata.get("version") != FORMAT_VERSION:
        raise FormatError("__metadata__.version", f"unsupported version {header.metadata.get('version')!r}", path)
    endor_specs = {}
    for key, spec in header.metadata.items():
        if key.startswith("endor."):
            endor_specs[key[len("endor.") :]] = _parse_spec(key, spec, header.tensors, path)
    try:
        flat = load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise FormatError("data", str(e), path) from e
    out: dict[str, EndorTensor | torch.Tensor] = {}
    for name, (shape, dtype) in endor_specs.items():
        values, bitmap, row_offsets = (flat.pop(f"{name}.{part}") for part in PARTS)
        if values.dtype != dtype:
            raise FormatError(f"{name}.values", f"dtype {values.dtype} disagrees with metadata {dtype}", path)
        out[name] = EndorTensor(values, bitmap, row_offsets, shape, source=path).to(device)
    out.update({name: t.to(device) for name, t in flat.items()})
    return out


def _parse_spec(key: str, spec: str, entries: Mapping, path: str) -> tuple[tuple[int, int], torch.dtype]:
    name = key[len("endor.") :]
    try:
        parsed = json.loads(spec)
        shape, dtype = tuple(parsed["shape"]), _DTYPE_NAMES[parsed["dtype"]]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise FormatError(key, f"bad spec {spec!r} ({e!r})", path) from None
    if len(shape) != 2 or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise FormatError(f"{key}.shape", f"must be two non-negative integers, got {shape}", path)
    for part in PARTS:
        if f"{name}.{part}" not in entries:
            raise FormatError(f"{name}.{part}", "missing", path)
    return shape, dtype


def prune(
    w: torch.Tensor,
    sparsity: float = 0.5,
    method: str = "magnitude",
    activations: torch.Tensor | None = None,
    structure: str | None = None,
) -> torch.Tensor:
    """Zero the lowest-scoring weights of a Linear weight w [out, in]; returns a pruned copy.

    method: "magnitude" scores |w|; "wanda" scores |w| * ||x_j||_2 with `activations` the layer inputs [..., in]
      (Sun et al. 2023). Scores are compared within each output row, as Wanda does.
    structure: None for unstructured `sparsity`; "N:M" (e.g. "2:4") keeps the N best of every M consecutive inputs.
    """
    if w.dim() != 2:
        raise ValueError(f"prune expects a 2-D weight [out, in], got shape {tuple(w.shape)}")
    score = w.detach().float().abs()
    if method == "wanda":
        if activations is None or activations.shape[-1] != w.shape[1]:
            raise ValueError(
                f"wanda needs activations [..., {w.shape[1]}], got "
                f"{None if activations is None else tuple(activations.shape)}"
            )
        score = score * activations.detach().float().reshape(-1, w.shape[1]).norm(dim=0)
    elif method != "magnitude":
        raise ValueError(f"method must be 'magnitude' or 'wanda', got {method!r}")
    if structure is None:
        if not 0.0 <= sparsity < 1.0:
            raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
        n_prune = int(round(w.shape[1] * sparsity))
        keep = torch.ones_like(score, dtype=torch.bool)
        if n_prune:
            keep.scatter_(1, score.topk(n_prune, dim=1, largest=False).indices, False)
    else:
        n, m = _parse_structure(structure)
        if w.shape[1] % m:
            raise ValueError(f"{structure} needs in-features divisible by {m}, got {w.shape[1]}")
        groups = score.view(w.shape[0], -1, m)
        keep = torch.zeros_like(groups, dtype=torch.bool)
        keep.scatter_(2, groups.topk(n, dim=2).indices, True)
        keep = keep.view_as(score)
    return torch.where(keep, w, torch.zeros((), dtype=w.dtype, device=w.device))


def _parse_structure(structure: str) -> tuple[int, int]:
    try:
        n, m = (int(p) for p in structure.split(":"))
    except ValueError:
        raise ValueError(f"structure must look like 'N:M', got {structure!r}") from None
    if not 0 < n <= m:
        raise ValueError(f"structure {structure!r} needs 0 < N <= M")
    return n, m
