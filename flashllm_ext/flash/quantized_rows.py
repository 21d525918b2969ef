"""A quantized store's rows made from a checkpoint (flashllm_ext.flash.convert's dtypes "q8" and "q4"): which block
format the up/gate rows take, which of a GGUF's tensors keep their blocks bit for bit, the rest quantized (round to
nearest a chunk of rows at a time, or GPTQ against each weight's inputs on calibration text), and the record of each
FFN tensor's path (store.tensor_sources)."""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterable

import torch
from tqdm.auto import tqdm

from flashllm_ext.flash.store import WEIGHT_ROLES
from flashllm_ext.hub.hf import collect_linear_inputs, load_hf_model
from flashllm_ext.hub.text import corpus_token_ids, spread_windows
from flashllm_ext.io.checkpoint import Checkpoint, GGUFCheckpoint
from flashllm_ext.ops.blocks import (
    BLOCK_FORMATS,
    BundleFormat,
    quantize_columns_gptq,
    quantize_rows,
    quantize_rows_gptq,
)
from flashllm_ext.ops.gptq import gptq_factor

# The quantized dtypes -> the block formats their up/gate rows may take: the first, unless more of a GGUF's up/gate
# tensors are already in another one (a Q4_1 file to q4), whose blocks are then kept bit for bit.
QUANTIZED_DTYPES = {"q8": ("q8_0",), "q4": ("q4_0", "q4_1")}
DEFAULT_DOWN_FORMAT = "q8_0"
QUANTIZED_FLOAT_DTYPE = "fp16"  # a quantized store's resident tensors (and so its activations)
FLOAT_SOURCES = ("F16", "BF16", "F32", "F64")  # tensor types a quantized store quantizes (others it requantizes)
# float32 bytes converted at a time: quantize_rows makes several float32 temporaries of its input (about 1.2 GB
# for a whole 8B-model FFN matrix), and an 8B model's embedding is 2.1 GB in fp32.
CHUNK_BYTES = 32 << 20
# How the FFN rows and attention projections a store quantizes (not the kept ones) are rounded: to the nearest code,
# or by GPTQ (flashllm_ext.ops.gptq) against their inputs on CALIBRATION_WINDOWS windows of the calibration text.
ROUNDINGS = ("nearest", "gptq")
CALIBRATION_WINDOWS, CALIBRATION_WINDOW = 8, 256
# Each calibration window's first token counts as this many in GPTQ's H: the first token of a sequence is the
# attention sink every later token attends to, so an error in what a layer makes of it reaches every token, where
# equal weights (8 of 2048 rows) let GPTQ trade its error away. On the default model's attention projections at q4_0
# (from fp16): perplexity 1.087x the GGUF's with equal weights, 1.0067x with 32, 1.013x with 256; 1.054x to nearest.
SINK_WEIGHT = 32


def commonest_format(ckpt: Checkpoint, names: Iterable[str], formats: tuple[str, ...]) -> str:
    """The one of `formats` most of tensors `names` already have in the file (their blocks are kept), the first on
    a tie."""
    types = Counter(ckpt.source_type(name) for name in names)
    return max(formats, key=lambda f: (types[f.upper()], f == formats[0]))


def keeps_blocks(ckpt: Checkpoint, name: str, fmt: str) -> bool:
    """Whether the rows of input tensor `name` are copied block for block: a GGUF tensor already in `fmt`."""
    return isinstance(ckpt, GGUFCheckpoint) and ckpt.source_type(name) == fmt.upper()


def layer_tensor_sources(
    ckpt: Checkpoint, roles: dict[str, str], bundle_format: BundleFormat, rounding: str = "nearest"
) -> dict[str, str]:
    """How each FFN weight of one layer reaches a quantized store, e.g. {"up": "kept Q4_0 blocks", "down":
    "requantized Q4_0 -> q8_0", ...} ("quantized F16 -> q4_0" from a float tensor; ", GPTQ" after the ones GPTQ
    rounds)."""
    sources = {}
    for role in WEIGHT_ROLES:
        if role not in roles:
            continue
        name = roles[role]
        fmt = bundle_format.down_format if role == "down" else bundle_format.in_format
        kept = role != "down" and keeps_blocks(ckpt, name, fmt)
        sources[role] = tensor_source(ckpt, name, fmt, kept) + (", GPTQ" if rounding == "gptq" and not kept else "")
    return sources


def tensor_source(ckpt: Checkpoint, name: str, fmt: str, kept: bool) -> str:
    """How tensor `name` reaches a quantized store in format `fmt`: "kept Q4_0 blocks" (kept), else "quantized F16 ->
    q4_0" from a float type or "requantized Q6_K -> q4_0" from another."""
    kind = ckpt.source_type(name)
    if kept:
        return f"kept {kind} blocks"
    return f"{'quantized' if kind in FLOAT_SOURCES else 'requantized'} {kind} -> {fmt}"


def describe_sources(sources: list[dict[str, str]]) -> str:
    """One line counting a quantized store's FFN tensors per path (store.tensor_sources), the commonest first:
    "64 kept Q4_0 blocks, 32 requantized Q4_0 -> q8_0"."""
    counts = Counter(path for layer in sources for path in layer.values())
    return ", ".join(f"{n} {path}" for path, n in counts.most_common())


def quantized_bundles(
    ckpt: Checkpoint,
    roles: dict[str, str],
    bundle_format: BundleFormat,
    calibration: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One layer's quantized bundle rows, uint8 [n_neurons, bundle_format.row_bytes(d, glu)]: the up and gate
    rows kept block for block where the checkpoint holds them in the input format (keeps_blocks), else quantized;
    the down row quantized along the hidden dimension. Quantized rows are rounded to nearest (as
    BundleFormat.quantize), or by GPTQ against the inputs of their weights given in `calibration` (weight name ->
    inputs [N, in]: calibration_inputs)."""
    calibration = calibration or {}
    parts = []
    for role in ("up", "gate"):
        if role in roles:
            name = roles[role]
            if keeps_blocks(ckpt, name, bundle_format.in_format):
                parts.append(ckpt.raw_blocks(name)[0])
            elif name in calibration:
                factor = calibration_factor(calibration[name])
                parts.append(quantize_rows_gptq(ckpt[name], bundle_format.in_format, factor))
            else:
                parts.append(quantize_in_chunks(ckpt[name], bundle_format.in_format))
    name = roles["down"]
    if name in calibration:
        factor = calibration_factor(calibration[name])
        parts.append(quantize_columns_gptq(ckpt[name], bundle_format.down_format, factor))
    else:
        parts.append(quantize_in_chunks(ckpt[name].t(), bundle_format.down_format))
    return torch.cat(parts, dim=1)


def calibration_factor(inputs: torch.Tensor) -> torch.Tensor:
    """gptq_factor of a weight's calibration inputs [N, in] (CALIBRATION_WINDOW tokens a window, as
    calibration_inputs captures them), each window's first token weighted SINK_WEIGHT."""
    weights = torch.ones(inputs.shape[0])
    weights[::CALIBRATION_WINDOW] = SINK_WEIGHT
    return gptq_factor(inputs, weights)


def calibration_inputs(
    checkpoint: str | os.PathLike, weight_names: list[str], progress: bool = True
) -> dict[str, torch.Tensor]:
    """Weight name -> fp16 [N, in]: what each named linear weight multiplies over CALIBRATION_WINDOWS windows of
    the calibration text, the checkpoint's model run by `transformers` (in memory, in float32, once) and its own
    tokenizer reading the text. Names as the checkpoint gives them (a module's, or the model's after "model.")."""
    model, tokenizer = load_hf_model(checkpoint)
    if tokenizer is None:
        raise ValueError(f"{checkpoint}: GPTQ rounding runs the model on calibration text, and it has no tokenizer")
    modules = dict(model.named_modules())
    module_of = {}
    for name in weight_names:
        module = next(
            (m for m in (name.removesuffix(".weight"), "model." + name.removesuffix(".weight")) if m in modules), None
        )
        if module is None:
            raise ValueError(f"{checkpoint}: the model `transformers` builds has no module for the weight {name}")
        module_of[name] = module
    ids = spread_windows(corpus_token_ids(tokenizer, "calibration"), CALIBRATION_WINDOWS, CALIBRATION_WINDOW)
    chunks: dict[str, list[torch.Tensor]] = {name: [] for name in weight_names}
    windows = ids.split(CALIBRATION_WINDOW)
    for window in tqdm(windows, desc="capturing calibration inputs", unit="window", disable=not progress):
        inputs = collect_linear_inputs(model, window, list(set(module_of.values())))
        for name, module in module_of.items():
            chunks[name].append(inputs[module].half())
    return {name: torch.cat(c) for name, c in chunks.items()}


def quantize_in_chunks(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """quantize_rows(w [R, d], fmt) a block of rows at a time, bounding its float32 temporaries (CHUNK_BYTES)."""
    step = max(1, CHUNK_BYTES // (4 * w.shape[1]))
    return torch.cat([quantize_rows(w[i : i + step], fmt) for i in range(0, w.shape[0], step)])


# Resident weights a quantized store holds as blocks: the attention projections, the embedding and the LM head (the
# linears the decoder multiplies by, ops.quantized_linear; an embedding dequantizes the rows it looks up).
BLOCK_RESIDENT = re.compile(r"(?:self_attn\.(?:q|k|v|o|out)_proj|embed_tokens|lm_head)\.weight$")
ATTENTION_PROJECTION = re.compile(r"self_attn\.(?:q|k|v|o|out)_proj\.weight$")  # the resident blocks GPTQ rounds


def resident_block_formats(ckpt: Checkpoint, names: list[str], attention_format: str) -> dict[str, tuple[str, bool]]:
    """name -> (block format, kept) of the resident weights a quantized store holds as blocks: a GGUF tensor
    already in a block format keeps its blocks; any other is quantized, the attention to `attention_format` (a
    flash store's: its bundles' input format) and the embedding and LM head (every token's logits) to q8_0."""
    out = {}
    for name in names:
        if not BLOCK_RESIDENT.search(name) or len(ckpt.shape(name)) != 2:
            continue
        kind = ckpt.source_type(name).lower()
        if isinstance(ckpt, GGUFCheckpoint) and kind in BLOCK_FORMATS:
            out[name] = (kind, True)
        else:
            out[name] = ("q8_0" if "self_attn" not in name else attention_format, False)
    return out
