"""Writing flash stores: `convert` (a checkpoint into a store, verified by reading it back) and `synthesize`
(random weights with a real model's FFN shapes, for benchmarks). The layout is `flashllm_ext.flash.store`'s.

convert reads the checkpoint one tensor at a time (flashllm_ext.io.checkpoint) and writes one FFN layer at a time:
per layer, the up/gate/down weights become one bundle matrix [n_neurons, bundle_width] (bundle_layer), everything
else goes to the resident file in the store dtype (float tensors only), a block of rows at a time.

Quantized stores (dtype "q8" or "q4", QUANTIZED_DTYPES) hold GGUF's blocks (flashllm_ext.ops.blocks.BundleFormat):
up and gate rows in the input format, the down row in `down_format`, resident tensors in fp16. A GGUF's up/gate
tensors already in the input format are copied block for block (nothing of the file's quantization is lost); its
down tensor's blocks run along the neuron dimension, not the hidden one, so down is dequantized and quantized again,
as are tensors of other types (K-quants, floats). Each tensor's path is recorded (store.tensor_sources); how those
rows are made: flashllm_ext.flash.quantized_rows.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from flashllm_ext import endor
from flashllm_ext.io.checkpoint import Checkpoint, open_checkpoint, unsupported_model
from flashllm_ext.errors import FormatError
from flashllm_ext.io.paths import check_out_dir, install_dir, staging_dir
from flashllm_ext.io.safetensors import DTYPE_SIZES, FLOAT_DTYPES, AlignedWriter, TensorSpec, dtype_name, save_tensors
from flashllm_ext.io.buffers import ALIGNMENT
from flashllm_ext.flash.store import (
    BUNDLES_FILE,
    EXPERT_FIELD,
    DENSE_FORMAT,
    DTYPES,
    FORMAT_VERSION,
    MAGIC,
    RESIDENT_FILE,
    WEIGHT_ROLES,
    FlashStore,
    expert_name,
    layer_specs,
    layer_tensor_name,
    neuron_order_problem,
)
from flashllm_ext.flash.quantized_rows import (
    CHUNK_BYTES,
    DEFAULT_DOWN_FORMAT,
    QUANTIZED_DTYPES,
    ATTENTION_PROJECTION,
    QUANTIZED_FLOAT_DTYPE,
    ROUNDINGS,
    calibration_factor,
    calibration_inputs,
    commonest_format,
    keeps_blocks,
    layer_tensor_sources,
    quantized_bundles,
    resident_block_formats,
)
from flashllm_ext.ops.blocks import BLOCK_FORMATS, BundleFormat, block_format, quantize_rows, quantize_rows_gptq

# FFN tensor names of the supported families: Llama/Mistral/SmolLM (gate/up/down) and OPT (fc1/fc2), and the experts
# of the mixture-of-experts families (Mixtral's block_sparse_moe.experts.{e}.w1/w3/w2, Qwen-MoE's and OLMoE's
# mlp.experts.{e}.gate_proj/up_proj/down_proj). The only place a family's naming scheme is read: the store records
# the names it finds per layer and role (store.ffn_roles; an expert's with EXPERT_FIELD in place of its number).
_FFN_NAME = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(?:mlp\.)?(gate_proj|up_proj|down_proj|fc1|fc2)\.(weight|bias)$")
_EXPERT_NAME = re.compile(
    r"^((?:.*\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.)(\d+)(\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight)$"
)
_ROLE = {"gate_proj": "gate", "up_proj": "up", "fc1": "up", "down_proj": "down", "fc2": "down"}
_ROLE.update({"w1": "gate", "w3": "up", "w2": "down"})  # Mixtral's expert weights
_VERIFY_SAMPLES = 4  # neurons per layer read back after writing
STORE_FILES = (BUNDLES_FILE, RESIDENT_FILE)  # what convert writes: --force replaces these and nothing else


def _ffn_layout(names: list[str], model_type: object) -> tuple[dict[int, dict[str, str]], bool, int]:
    """Per layer in layer order, role -> tensor name of its FFN weights (up, gate, down) and biases (up_bias, ...);
    whether the model is gated (GLU); and its experts per layer (0: a dense model; an MoE layer's names hold
    EXPERT_FIELD in place of the expert's number). `model_type` (the config's) names the model in errors."""
    layers: dict[int, dict[str, str]] = {}
    experts: dict[int, set[int]] = {}
    for name in names:
        m = _FFN_NAME.match(name)
        if m:
            role = _ROLE[m.group(2)] + ("_bias" if m.group(3) == "bias" else "")
            layers.setdefault(int(m.group(1)), {})[role] = name
            continue
        m = _EXPERT_NAME.match(name)
        if m:
            layer = int(m.group(2))
            layers.setdefault(layer, {})[_ROLE[m.group(5)]] = m.group(1) + EXPERT_FIELD + m.group(4)
            experts.setdefault(layer, set()).add(int(m.group(3)))
    if not layers:
        raise unsupported_model(
            model_type,
            "no FFN weights named as in Llama, Mistral or SmolLM (layers.{i}.mlp.gate_proj/up_proj/down_proj), "
            "OPT (layers.{i}.fc1/fc2) or an MoE family (layers.{i}.mlp.experts.{e}.*, Mixtral's "
            "block_sparse_moe.experts.{e}.w1/w2/w3)",
        )
    if sorted(layers) != list(range(len(layers))):
        raise FormatError("layers", f"non-contiguous layer numbers {sorted(layers)[:8]}")
    n_experts = len(experts.get(0, ()))
    for layer in layers:
        found = experts.get(layer, set())
        if found != set(range(n_experts)):
            raise unsupported_model(
                model_type,
                f"layer {layer} has experts {sorted(found)[:8]} where layer 0 has {n_experts}: models mixing dense "
                "and expert layers, or with gaps in their expert numbers, are not supported",
            )
    # Numeric order: tensor names sort as strings (layers.10 before layers.2), and the header's declaration order
    # must be the order the layers are written in.
    layers = dict(sorted(layers.items()))
    glu = "gate" in layers[0]
    for layer, roles in layers.items():
        needed = {"up", "down"} | ({"gate"} if glu else set())
        weights = set(roles) & set(WEIGHT_ROLES)
        if weights != needed:
            raise FormatError(f"layers.{layer}", f"FFN weights {sorted(weights)}, expected {sorted(needed)}")
        if n_experts and set(roles) != weights:
            raise FormatError(f"layers.{layer}", f"expert FFNs with biases ({sorted(roles)}) are not supported")
    return layers, glu, n_experts


def _bundled_roles(roles: dict[str, str], n_experts: int) -> list[dict[str, str]]:
    """The role -> tensor name maps whose bundles make up one layer, in store order: the layer's own (a dense
    model), or each expert's (an MoE layer: expert e's neurons are rows [e * size, (e + 1) * size))."""
    if not n_experts:
        return [roles]
    return [{role: expert_name(name, e) for role, name in roles.items()} for e in range(n_experts)]


def bundle_layer(up: torch.Tensor, down: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Row-column bundling of one FFN layer.

    up, gate: nn.Linear weights [ffn, d] (neuron i's input column is row i); down: [d, ffn] (its output row is
    column i). Returns [ffn, bundle_width] with row i = [up[i] | gate[i] | down[:, i]], bundle_width = 2d or 3d.
    """
    parts = [up] + ([gate] if gate is not None else []) + [down.t()]
    ffn = up.shape[0]
    if any(p.dim() != 2 or p.shape[0] != ffn for p in parts):
        raise ValueError(
            f"FFN shapes disagree: up {tuple(up.shape)}, down {tuple(down.shape)}, "
            f"gate {None if gate is None else tuple(gate.shape)}"
        )
    return torch.cat(parts, dim=1).contiguous()


def convert(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: str = "fp16",
    endor: bool = False,
    force: bool = False,
    progress: bool = True,
    down_format: str | None = None,
    neuron_order: torch.Tensor | None = None,
    rounding: str = "nearest",
    calibration: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Convert a Hugging Face safetensors directory (OPT, Llama/Mistral/SmolLM; sharded or not) or a GGUF file
    into a flash store at `out_dir`. Atomic: written under a temporary name and renamed at the end, then a sample
    of every layer is read back and compared. Refuses to replace an existing `out_dir` unless `force`, and even
    then anything but a flash store or an empty directory (paths.check_out_dir). Returns `out_dir`, absolute.

    dtype: "fp16", "bf16" or "fp32" (float bundles), or a quantized one (QUANTIZED_DTYPES, see the module doc):
    "q8" (q8_0 rows) or "q4" (q4_0 up/gate rows, q4_1 from a GGUF whose up/gate tensors are Q4_1), the down row
    in `down_format` (a flashllm_ext.ops.blocks format, default q8_0). Endor compression takes float bundles only.

    rounding (quantized dtypes, dense models): how the FFN rows and attention projections the store quantizes are
    rounded, "nearest" or "gptq" (quantized_rows.ROUNDINGS): against what each weight multiplies, `calibration`
    (weight name -> inputs [N, in] in windows of quantized_rows.CALIBRATION_WINDOW tokens), which
    quantized_rows.calibration_inputs captures (running the checkpoint's model on calibration text) when None.

    neuron_order: int [n_layers, n_neurons], the model neuron each bundle row holds (flashllm_ext.predictor.placement
    .neuron_orders): every layer's rows and per-neuron biases are written in that order and the order is recorded
    (FlashStore.neuron_order), so a token's set maps onto the rows it lies in. Dense models only (an expert's rows
    stay together).
    """
    quantized = dtype in QUANTIZED_DTYPES
    if dtype not in DTYPES and not quantized:
        raise ValueError(f"dtype must be one of {[*DTYPES, *QUANTIZED_DTYPES]}, got {dtype!r}")
    if quantized and endor:
        raise ValueError(f"Endor compression takes float bundles (dtype {list(DTYPES)}), not {dtype!r} blocks")
    if down_format is not None and not quantized:
        raise ValueError(f"down_format applies to the quantized dtypes {list(QUANTIZED_DTYPES)}, not {dtype!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if calibration is not None and rounding != "gptq":
        raise ValueError(f"calibration inputs apply to rounding 'gptq', not {rounding!r}")
    if rounding != "nearest" and not quantized:
        raise ValueError(
            f"rounding {rounding!r} applies to the quantized dtypes {list(QUANTIZED_DTYPES)}, not {dtype!r}"
        )
    down_format = block_format(down_format or DEFAULT_DOWN_FORMAT).name
    out_dir = check_out_dir(out_dir, force, STORE_FILES, checkpoint)
    ckpt = open_checkpoint(checkpoint)
    layers, glu, n_experts = _ffn_layout(ckpt.names, ckpt.config.get("model_type"))
    if rounding == "gptq" and n_experts:
        raise ValueError(
            "rounding 'gptq' takes dense models: an expert's calibration inputs are the tokens routed to it"
        )
    float_dtype = QUANTIZED_FLOAT_DTYPE if quantized else dtype
    torch_dtype = DTYPES[float_dtype]
    bundled = {layer: _bundled_roles(roles, n_experts) for layer, roles in layers.items()}
    size, hidden = ckpt.shape(bundled[0][0]["up"])
    ffn = size * max(1, n_experts)
    if neuron_order is not None:
        neuron_order = torch.as_tensor(neuron_order).long()
        problem = neuron_order_problem(neuron_order, len(layers), ffn)
        if n_experts or problem is not None:
            raise ValueError(f"neuron_order: {problem or 'an MoE model keeps the rows of each expert together'}")
    bundle_format, sources = None, None
    if quantized:
        up_gate = (roles[r] for layer in bundled.values() for roles in layer for r in ("up", "gate") if r in roles)
        bundle_format = BundleFormat(commonest_format(ckpt, up_gate, QUANTIZED_DTYPES[dtype]), down_format)
        sources = [layer_tensor_sources(ckpt, parts[0], bundle_format, rounding) for parts in bundled.values()]
    weights = {name for parts in bundled.values() for roles in parts for r, name in roles.items() if r in WEIGHT_ROLES}
    resident_names = [n for n in ckpt.names if n not in weights]
    blocks = resident_block_formats(ckpt, resident_names, bundle_format.in_format) if quantized else {}
    if rounding == "gptq":
        calibration = _gptq_calibration(checkpoint, ckpt, bundled, bundle_format, blocks, calibration, progress)
    metadata = _bundles_metadata(
        ckpt.config, float_dtype, ffn, hidden, glu, endor, list(layers.values()), bundle_format, sources
    )
    if n_experts:
        metadata["experts"] = json.dumps({"count": n_experts, "size": size})
    if neuron_order is not None:
        metadata["neuron_order"] = json.dumps(neuron_order.tolist())
    tmp = staging_dir(out_dir)
    try:
        expected = _write_bundles(
            tmp / BUNDLES_FILE,
            ckpt,
            bundled,
            torch_dtype,
            endor,
            size,
            hidden,
            metadata,
            progress,
            bundle_format,
            neuron_order,
            calibration,
        )
        reordered = (
            {}
            if neuron_order is None
            else {
                name: neuron_order[layer]
                for layer, roles in layers.items()
                for role, name in roles.items()
                if role in ("up_bias", "gate_bias")
            }
        )
        resident = _write_resident(
            tmp / RESIDENT_FILE,
            ckpt,
            resident_names,
            torch_dtype,
            float_dtype,
            progress,
            blocks,
            reordered,
            calibration,
        )
        with FlashStore(tmp) as written:
            _verify(written, expected, resident)
        install_dir(tmp, out_dir, STORE_FILES)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out_dir


def _gptq_calibration(
    checkpoint: str | os.PathLike,
    ckpt: Checkpoint,
    layers: dict[int, list[dict[str, str]]],
    bundle_format: BundleFormat,
    resident_blocks: dict[str, tuple[str, bool]],
    calibration: dict[str, torch.Tensor] | None,
    progress: bool,
) -> dict[str, torch.Tensor]:
    """The calibration inputs of every weight GPTQ rounds, the FFN weights the store quantizes (not the up/gate
    blocks it keeps) and the attention projections among the resident blocks it quantizes: `calibration` checked to
    hold them, or captured (quantized_rows.calibration_inputs). The embedding and LM head stay rounded to nearest."""
    names = [
        name
        for parts in layers.values()
        for roles in parts
        for role, name in roles.items()
        if role == "down" or (role in WEIGHT_ROLES and not keeps_blocks(ckpt, name, bundle_format.in_format))
    ]
    names += [n for n, (_, kept) in resident_blocks.items() if not kept and ATTENTION_PROJECTION.search(n)]
    if calibration is None:
        return calibration_inputs(checkpoint, names, progress)
    missing = [n for n in names if n not in calibration]
    if missing:
        raise ValueError(f"calibration inputs lack {len(missing)} of the weights GPTQ rounds, e.g. {missing[0]}")
    return calibration


def _write_resident(
    path: Path,
    ckpt: Checkpoint,
    names: list[str],
    dtype: torch.dtype,
    dtype_key: str,
    progress: bool,
    block_formats: dict[str, tuple[str, bool]] | None = None,
    reordered: dict[str, torch.Tensor] | None = None,
    calibration: dict[str, torch.Tensor] | None = None,
) -> tuple[str, torch.Tensor] | None:
    """Write the resident tensors one block of rows at a time (a 7B model's attention is gigabytes, its embedding
    alone 1-2 GB in fp32); returns the first tensor's name and first block, for verification. Packed as the
    safetensors library packs them: widest element size first, so each tensor is aligned to its element size
    without padding tensors. block_formats (resident_block_formats): the weights written as uint8 rows of blocks,
    listed in the `resident_formats` metadata, rounded by GPTQ against their `calibration` inputs where given (whole,
    not a block of rows at a time: an attention projection). reordered: per-neuron tensors (an FFN's input biases)
    written in the order given, as their layer's bundle rows."""
    block_formats, calibration = block_formats or {}, calibration or {}
    store_name = dtype_name(dtype)

    def spec_of(n: str) -> TensorSpec:
        if n in block_formats:
            rows, cols = ckpt.shape(n)
            return TensorSpec(n, "U8", (rows, BLOCK_FORMATS[block_formats[n][0]].row_bytes(cols)))
        return TensorSpec(n, store_name if ckpt.dtype(n) in FLOAT_DTYPES else ckpt.dtype(n), ckpt.shape(n))

    specs = [spec_of(n) for n in names]
    specs.sort(key=lambda spec: -DTYPE_SIZES[spec.dtype])
    samples: dict[str, torch.Tensor] = {}

    def blocks(name: str) -> Iterator[torch.Tensor]:
        if name in block_formats:
            fmt, kept = block_formats[name]
            if kept:
                chunks = [ckpt.raw_blocks(name)[0]]
            elif name in calibration:
                chunks = [quantize_rows_gptq(ckpt[name], fmt, calibration_factor(calibration[name]))]
            else:
                chunks = (quantize_rows(c, fmt) for c in ckpt.row_chunks(name, CHUNK_BYTES))
        elif reordered and name in reordered:
            chunks = [_to_store_dtype(ckpt[name][reordered[name]], dtype)]
        else:
            chunks = (_to_store_dtype(c, dtype) for c in ckpt.row_chunks(name, CHUNK_BYTES))
        for chunk in chunks:
            chunk = chunk.contiguous()
            if not samples:
                samples[name] = chunk
            yield chunk

    metadata = {"magic": MAGIC, "format_version": FORMAT_VERSION, "dtype": dtype_key}
    if block_formats:
        formats = {n: [fmt, ckpt.shape(n)[1]] for n, (fmt, _) in block_formats.items()}
        metadata["resident_formats"] = json.dumps(formats)
    with AlignedWriter(path, specs, metadata, alignment=8, tensor_alignment=1) as writer:
        for spec in tqdm(specs, desc="writing resident tensors", unit="t", disable=not progress):
            writer.write_rows(spec.name, blocks(spec.name))
    return next(iter(samples.items()), None)


def _to_store_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A resident tensor in the store's float dtype if it is a float tensor. Integer and bool buffers (position ids,
    index tables, masks) keep their dtype: a float cast would change what they mean and lose values (fp16 holds
    integers exactly only up to 2048)."""
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _bundles_metadata(
    config: dict,
    dtype: str,
    n_neurons: int,
    hidden: int,
    glu: bool,
    use_endor: bool,
    ffn_roles: list[dict[str, str]],
    bundle_format: BundleFormat | None = None,
    tensor_sources: list[dict[str, str]] | None = None,
) -> dict[str, str]:
    width = (3 if glu else 2) * hidden
    metadata = {
        "magic": MAGIC,
        "format_version": FORMAT_VERSION,
        "config": json.dumps(config),
        "dtype": dtype,
        "bundle_width": str(width),
        "n_layers": str(len(ffn_roles)),
        "n_neurons": str(n_neurons),
        "hidden_size": str(hidden),
        "glu": str(int(glu)),
        "alignment": str(ALIGNMENT),
        "endor": str(int(use_endor)),
        "bundle_format": bundle_format.name if bundle_format else DENSE_FORMAT,
        "ffn_roles": json.dumps(ffn_roles),
    }
    if tensor_sources is not None:
        metadata["tensor_sources"] = json.dumps(tensor_sources)
    return metadata


def synthesize(
    out_dir: str | os.PathLike,
    n_layers: int,
    hidden_size: int,
    n_neurons: int,
    glu: bool = False,
    dtype: str = "fp16",
    seed: int = 0,
) -> Path:
    """A store of random weights with a real model's FFN shapes (e.g. OPT-6.7B: hidden 4096, 16384 neurons), for
    I/O benchmarks at a scale no checkpoint here has. No resident tensors. Written one layer at a time."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch_dtype = DTYPES[dtype]
    width = (3 if glu else 2) * hidden_size
    # The activation of the families these shapes come from: OPT's ReLU, Llama's SiLU (SwiGLU).
    config = {
        "model_type": "synthetic",
        "hidden_size": hidden_size,
        "intermediate_size": n_neurons,
        "num_hidden_layers": n_layers,
        "hidden_act": "silu" if glu else "relu",
    }
    specs = [spec for layer in range(n_layers) for spec in layer_specs(layer, n_neurons, width, torch_dtype, None)]
    generator = torch.Generator().manual_seed(seed)
    # No checkpoint: the weight roles are named after the bundle tensor that holds them; no biases.
    roles = [
        {role: f"{layer_tensor_name(layer)}.{role}" for role in WEIGHT_ROLES if glu or role != "gate"}
        for layer in range(n_layers)
    ]
    metadata = _bundles_metadata(config, dtype, n_neurons, hidden_size, glu, False, roles)
    with AlignedWriter(out_dir / BUNDLES_FILE, specs, metadata, ALIGNMENT) as writer:
        for layer in range(n_layers):
            writer.write(
                layer_tensor_name(layer),
                torch.randn((n_neurons, width), generator=generator, dtype=torch.float32).to(torch_dtype),
            )
    save_tensors({}, out_dir / RESIDENT_FILE, {"magic": MAGIC, "format_version": FORMAT_VERSION, "dtype": dtype})
    return out_dir


def _write_bundles(
    path: Path,
    ckpt: Checkpoint,
    layers: dict[int, list[dict[str, str]]],
    dtype: torch.dtype,
    use_endor: bool,
    size: int,
    hidden: int,
    metadata: dict[str, str],
    progress: bool,
    bundle_format: BundleFormat | None = None,
    neuron_order: torch.Tensor | None = None,
    calibration: dict[str, torch.Tensor] | None = None,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Writes every layer (float bundles in `dtype`, or `bundle_format`'s quantized rows, GPTQ-rounded against the
    `calibration` inputs of the weights it has them for), each the bundles of its parts (_bundled_roles: the layer, or
    each of its experts, of `size` neurons) one after another, a dense layer's rows in `neuron_order` where given;
    returns per layer (sample row ids, their expected rows) for verification."""
    glu = "gate" in layers[0][0]
    width = (3 if glu else 2) * hidden
    quantized_row_bytes = None if bundle_format is None else bundle_format.row_bytes(hidden, glu)
    ffn = size * len(layers[0])

    def part_bundles(roles: dict[str, str]) -> torch.Tensor:
        for role, name in roles.items():
            want = (hidden, size) if role == "down" else (size, hidden)
            if role in WEIGHT_ROLES and tuple(ckpt.shape(name)) != want:
                raise FormatError(name, f"shape {tuple(ckpt.shape(name))}, expected {want} as in layer 0")
        if bundle_format is not None:
            return quantized_bundles(ckpt, roles, bundle_format, calibration)
        gate = ckpt[roles["gate"]].to(dtype) if "gate" in roles else None
        return bundle_layer(ckpt[roles["up"]].to(dtype), ckpt[roles["down"]].to(dtype), gate)

    def parts(layer: int) -> Iterator[torch.Tensor]:
        for roles in layers[layer]:
            part = part_bundles(roles)
            yield part if neuron_order is None else part[neuron_order[layer]]

    def bundles(layer: int) -> torch.Tensor:
        layer_parts = list(parts(layer))
        return layer_parts[0] if len(layer_parts) == 1 else torch.cat(layer_parts)

    # The header (written first) declares the length of each layer's Endor rows: a first pass counts the values, one
    # layer's dense bundles at a time; the second compresses and writes. Never more than one compressed layer in
    # memory (a model bigger than memory converts).
    nnz: dict[int, int] = {}
    if use_endor:
        for layer in tqdm(layers, desc="sizing Endor layers", unit="layer", disable=not progress):
            nnz[layer] = endor.count_nonzero(bundles(layer))
    specs = [s for l in layers for s in layer_specs(l, ffn, width, dtype, nnz.get(l), quantized_row_bytes)]
    expected = {}
    generator = torch.Generator().manual_seed(0)
    with AlignedWriter(path, specs, metadata, ALIGNMENT) as writer:
        for layer in tqdm(layers, desc="bundling FFN layers", unit="layer", disable=not progress):
            ids = torch.cat(
                [torch.tensor([0, ffn - 1]), torch.randint(0, ffn, (_VERIFY_SAMPLES - 2,), generator=generator)]
            )
            name = layer_tensor_name(layer)
            if use_endor:
                expected[layer] = (ids, _write_endor_layer(writer, name, bundles(layer), ids))
            else:  # an MoE layer one expert at a time: never the whole layer in memory
                samples: dict[int, torch.Tensor] = {}
                writer.write_rows(name, _sampled_parts(parts(layer), ids, samples))
                expected[layer] = (ids, torch.stack([samples[i] for i in ids.tolist()]))
    return expected


def _sampled_parts(parts: Iterator[torch.Tensor], ids: torch.Tensor, samples: dict[int, torch.Tensor]):
    """The layer's parts (consecutive blocks of its rows) as they come, keeping a copy of rows `ids` in `samples`."""
    start = 0
    for part in parts:
        for i in ids.tolist():
            if start <= i < start + len(part):
                samples[i] = part[i - start].clone()
        start += len(part)
        yield part


def _write_endor_layer(
    writer: AlignedWriter, name: str, layer_bundles: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Compress and write one layer in the rows layout (endor.pack_rows); returns its rows `ids` for verification.
    The compressed layer is freed on return, before the next is built."""
    compressed = endor.compress(layer_bundles)
    writer.write(f"{name}.rows", endor.pack_rows(compressed))
    writer.write(f"{name}.row_offsets", compressed.row_offsets)
    return compressed.decompress(ids)


def _verify(
    store: FlashStore,
    expected: dict[int, tuple[torch.Tensor, torch.Tensor]],
    resident: tuple[str, torch.Tensor] | None,
) -> None:
    for layer, (ids, want) in expected.items():
        if not torch.equal(store.bundle(layer, ids).view(torch.uint8), want.view(torch.uint8)):
            raise RuntimeError(
                f"{store.path}: read-back of layer {layer} neurons {ids.tolist()} differs from what was written"
            )
    if resident is not None:
        # The first rows only: reading a whole embedding back would double the converter's memory.
        name, want = resident
        with safe_open(store.resident_path, framework="pt") as f:
            got = f.get_slice(name)[: len(want)] if want.dim() else f.get_tensor(name)
        if not torch.equal(got, want):
            raise RuntimeError(f"{store.path}: read-back of resident tensor {name} differs from what was written")
