"""convert_offload: a checkpoint into a layer store, dense, Endor or quantized, written to staging and installed
whole."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flashllm_ext import endor
from flashllm_ext.io.checkpoint import Checkpoint, open_checkpoint, unsupported_model
from flashllm_ext.errors import FormatError
from flashllm_ext.io.paths import check_out_dir, install_dir, staging_dir
from flashllm_ext.io.safetensors import AlignedWriter, TensorSpec, save_tensors
from flashllm_ext.io.buffers import ALIGNMENT
from flashllm_ext.flash.quantized_rows import (
    QUANTIZED_DTYPES,
    QUANTIZED_FLOAT_DTYPE,
    commonest_format,
    keeps_blocks,
    quantize_in_chunks,
    resident_block_formats,
    tensor_source,
)
from flashllm_ext.flash.store import DTYPES
from flashllm_ext.offload.store import (
    END_TENSOR,
    FORMAT_VERSION,
    LAYERS_FILE,
    MAGIC,
    RESIDENT_FILE,
    STORE_FILES,
    TENSOR_ALIGNMENT,
    LayerStore,
    MatrixEntry,
    round_up,
)


_LAYER_WEIGHT = re.compile(r"^(?:.*\.)?layers\.(\d+)\..+\.weight$")
# A layer's matrices are stored in the order the lean decoder fuses them (q, k and v one matrix, the GLU's gate and
# up one), so that an SSD layer's fused matrices are views over the bytes read (flashllm_ext.decoder.offload);
# other matrices (experts) follow in the checkpoint's order.
_FUSED_ORDER = [
    f"{part}.weight"
    for part in (
        *(f"self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "out_proj")),
        *(f"mlp.{m}" for m in ("gate_proj", "up_proj", "down_proj")),
        "fc1",
        "fc2",
    )
]


def _fused_rank(name: str) -> int:
    return next((i for i, suffix in enumerate(_FUSED_ORDER) if name.endswith(f".{suffix}")), len(_FUSED_ORDER))


def _layer_matrices(ckpt: Checkpoint) -> list[list[str]]:
    """Per decoder layer, in layer order, the names of its 2-D `.weight` tensors (its Linear weights), in the
    order _FUSED_ORDER ranks them."""
    layers: dict[int, list[str]] = {}
    for name in ckpt.names:
        m = _LAYER_WEIGHT.match(name)
        if m and len(ckpt.shape(name)) == 2:
            layers.setdefault(int(m.group(1)), []).append(name)
    layers = {i: sorted(names, key=_fused_rank) for i, names in layers.items()}
    if not layers:
        raise unsupported_model(ckpt.config.get("model_type"), "no decoder-layer weights (layers.{i}.*.weight)")
    if sorted(layers) != list(range(len(layers))):
        raise FormatError("layers", f"non-contiguous layer numbers {sorted(layers)[:8]}")
    return [layers[i] for i in range(len(layers))]


def convert_offload(
    checkpoint: str | os.PathLike | Checkpoint,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "fp16",
    endor_compress: bool = False,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Write a layer store of `checkpoint` (a Hugging Face safetensors directory, a GGUF file, or a Checkpoint such
    as `TensorsCheckpoint(config, state_dict)`) at `out_dir`, one tensor in memory at a time.

    dtype: "fp16", "bf16" or "fp32", or "q8" / "q4": every decoder-layer matrix as rows of GGUF blocks (q8_0; q4_0
    or q4_1), which the decoder multiplies by as they are (ops.quantized_linear), and the embedding and LM head too
    (a lookup dequantizes its rows), the other resident tensors in float16. A GGUF matrix already in such a format
    keeps its blocks bit for bit (the blocks of every Linear weight run along its input dimension, W_down's too);
    any other layer matrix is quantized, round to nearest, to the format most of the file's matrices have (the first
    one on a tie), an embedding or LM head to q8_0. store.tensor_sources records each blocked tensor's path.
    endor_compress: store each matrix as Endor where that is smaller than dense (pruned weights; float dtypes); a
    first pass counts the non-zeros (the header declares every length before any data). Atomic (written under a
    temporary name, then renamed); refuses to replace `out_dir` unless `force`, and even then anything but a layer
    store or an empty directory (paths.check_out_dir). Returns `out_dir`, absolute."""
    if dtype not in DTYPES and dtype not in QUANTIZED_DTYPES:
        raise ValueError(f"dtype must be one of {[*DTYPES, *QUANTIZED_DTYPES]}, got {dtype!r}")
    if endor_compress and dtype in QUANTIZED_DTYPES:
        raise ValueError(f"Endor compression takes float matrices (dtype {list(DTYPES)}), not {dtype!r} blocks")
    out_dir = check_out_dir(out_dir, force, STORE_FILES, None if isinstance(checkpoint, Checkpoint) else checkpoint)
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint)
    quantized = dtype in QUANTIZED_DTYPES
    torch_dtype = DTYPES[QUANTIZED_FLOAT_DTYPE if quantized else dtype]
    layers = _layer_matrices(ckpt)
    block_forms = {}
    if quantized:
        formats = QUANTIZED_DTYPES[dtype]
        fallback = commonest_format(ckpt, (n for names in layers for n in names), formats)
        block_forms = {
            n: next((f for f in formats if keeps_blocks(ckpt, n, f)), fallback) for names in layers for n in names
        }
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
            compressed = (
                name in nnz and nnz[name] * item + rows * ((cols + 7) // 8) + (rows + 1) * 8 < rows * cols * item
            )
            form = block_forms.get(name) or ("endor" if compressed else "dense")
            layer.append(MatrixEntry(name, (rows, cols), form))
        entries.append(layer)
    # A layer is one read range: its first tensor starts on a block (a zero-filled `layers.{l}.align` tensor fills
    # the gap), the rest follow TENSOR_ALIGNMENT apart, so the padding costs at most a block per layer.
    specs, offset, pads = [], 0, []
    for i, layer in enumerate(entries):
        start = round_up(offset, TENSOR_ALIGNMENT)
        gap = round_up(start, ALIGNMENT) - start
        pads.append(TensorSpec(f"layers.{i}.align", "U8", (gap,)) if gap else None)
        specs += [pads[-1]] if gap else []
        offset = start + gap
        for spec in (s for e in layer for s in e.specs(torch_dtype, nnz.get(e.name, 0))):
            specs.append(spec)
            offset = round_up(offset, TENSOR_ALIGNMENT) + spec.nbytes
    start = round_up(offset, TENSOR_ALIGNMENT)
    specs.append(TensorSpec(END_TENSOR, "U8", (round_up(start, ALIGNMENT) - start,)))
    metadata = {
        "magic": MAGIC,
        "format_version": FORMAT_VERSION,
        "config": json.dumps(ckpt.config),
        "dtype": dtype,
        "alignment": str(ALIGNMENT),
        "tensor_alignment": str(TENSOR_ALIGNMENT),
        "layers": json.dumps([[[e.name, list(e.shape), e.form] for e in layer] for layer in entries]),
    }
    in_layers = {e.name for layer in entries for e in layer}
    resident_names = [n for n in ckpt.names if n not in in_layers]
    resident_forms = {}
    if quantized:
        resident_forms = {n: f for n, (f, _) in resident_block_formats(ckpt, resident_names, fallback).items()}
        forms = {**{e.name: e.block_format for layer in entries for e in layer}, **resident_forms}
        metadata["tensor_sources"] = json.dumps(
            {n: tensor_source(ckpt, n, fmt, keeps_blocks(ckpt, n, fmt)) for n, fmt in forms.items()}
        )
    tmp = staging_dir(out_dir)
    try:
        with AlignedWriter(tmp / LAYERS_FILE, specs, metadata, ALIGNMENT, TENSOR_ALIGNMENT) as writer:
            for pad, layer in tqdm(list(zip(pads, entries)), desc="writing layers", unit="layer", disable=not progress):
                if pad is not None:
                    writer.write(pad.name, torch.zeros(pad.shape, dtype=torch.uint8))
                for e in layer:
                    w = _stored(ckpt, e.name, e.block_format, torch_dtype)
                    if e.endor:
                        compressed = endor.compress(w)
                        for part in endor.PARTS:
                            writer.write(f"{e.name}.{part}", getattr(compressed, part))
                    else:
                        writer.write(e.name, w)
            writer.write(END_TENSOR, torch.zeros(specs[-1].shape, dtype=torch.uint8))
        resident = {n: _stored(ckpt, n, resident_forms.get(n), torch_dtype) for n in resident_names}
        resident_meta = {"magic": MAGIC, "format_version": FORMAT_VERSION}
        if resident_forms:
            formats = {n: [fmt, ckpt.shape(n)[1]] for n, fmt in resident_forms.items()}
            resident_meta["resident_formats"] = json.dumps(formats)
        save_tensors(resident, tmp / RESIDENT_FILE, resident_meta)
        _verify(LayerStore(tmp), ckpt, torch_dtype)
        install_dir(tmp, out_dir, STORE_FILES)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out_dir


def _stored(ckpt: Checkpoint, name: str, block_format: str | None, dtype: torch.dtype) -> torch.Tensor:
    """Tensor `name` as the store holds it before any Endor compression: its blocks in `block_format` (kept from the
    file, or quantized), or a float tensor in `dtype` (other tensors as they are)."""
    if block_format is None:
        t = ckpt[name]
        return (t.to(dtype) if t.is_floating_point() else t).contiguous()
    if keeps_blocks(ckpt, name, block_format):
        return ckpt.raw_blocks(name)[0]
    return quantize_in_chunks(ckpt[name], block_format)


def _verify(store: LayerStore, ckpt: Checkpoint, dtype: torch.dtype) -> None:
    """Read the first matrix of every layer back and compare it with what was written, bit for bit."""
    for layer in range(store.n_layers):
        entry = store.layers[layer][0]
        got = store.matrix(layer, entry.name)
        got = got.decompress() if isinstance(got, endor.EndorTensor) else getattr(got, "blocks", got)
        want = _stored(ckpt, entry.name, entry.block_format, dtype)
        if not torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)):
            raise RuntimeError(f"{store.path}: read-back of {entry.name} differs from what was written")
