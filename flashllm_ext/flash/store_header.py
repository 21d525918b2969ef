"""The flash store's header: the names and versions of its files and the validation of each metadata field, each a
FormatError naming the file and the field (flashllm_ext.flash.store opens a store with these)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from flashllm_ext.errors import FormatError
from flashllm_ext.io.safetensors import TensorEntry, TensorSpec, dtype_name
from flashllm_ext.ops.blocks import BLOCK_FORMATS, BundleFormat

MAGIC = "flashllm-store"
FORMAT_VERSION = "3"  # 3: bundle_format (quantized bundles); 2: ffn_roles
READABLE_VERSIONS = ("2", "3")  # a version-2 store has float bundles in `dtype`
DENSE_FORMAT = "float"  # bundle_format of float bundles in the store's dtype
ALIGNMENT = 4096
BUNDLES_FILE = "bundles.safetensors"
RESIDENT_FILE = "resident.safetensors"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
WEIGHT_ROLES = ("up", "gate", "down")  # gate only in GLU models
EXPERT_FIELD = "{expert}"  # in an MoE store's ffn_roles: where each expert's number goes in its tensor names
BIAS_ROLES = ("up_bias", "gate_bias", "down_bias")
# The sizes a model is built from (Hugging Face config names of the supported families).
CONFIG_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "ffn_dim",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


def json_field(raw: str, field: str, path: str):
    """A metadata entry's JSON value; FormatError naming the field when it is not JSON."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise FormatError(field, f"not JSON ({e})", path) from None


def parse_model_config(raw: str | None, path: str, resident: dict[str, TensorEntry]) -> dict:
    """The model config in a store's `config` metadata entry: a JSON object whose sizes (CONFIG_SIZES, where given)
    are positive integers and whose vocab_size is the row count of a resident tensor (the embedding), so a model is
    never built from sizes the files do not back (a vocab_size of 1e11). FormatError naming the field otherwise."""
    field = "__metadata__.config"
    config = json_field(raw if raw is not None else "", field, path)
    if not isinstance(config, dict):
        raise FormatError(field, f"must be a JSON object, got {type(config).__name__}", path)
    for key in CONFIG_SIZES:
        value = config.get(key)
        if value is not None and (type(value) is not int or value <= 0):
            raise FormatError(f"{field}.{key}", f"must be a positive integer, got {value!r}", path)
    vocab = config.get("vocab_size")
    if vocab is not None and not any(len(e.shape) == 2 and e.shape[0] == vocab for e in resident.values()):
        raise FormatError(
            f"{field}.vocab_size", f"{vocab} is the row count of no resident tensor (the embedding)", path
        )
    return config


def expert_name(name: str, expert: int) -> str:
    """Expert `expert`'s tensor of an MoE store's ffn_roles name (EXPERT_FIELD replaced by its number)."""
    return name.replace(EXPERT_FIELD, str(expert))


@dataclass(frozen=True)
class ExpertLayout:
    """An MoE store's layers: `count` experts of `size` neurons each, expert e the bundle rows [e * size,
    (e + 1) * size) of its layer, one contiguous range of the file."""

    count: int
    size: int

    def rows(self, expert: int) -> range:
        return range(expert * self.size, (expert + 1) * self.size)


def parse_experts(raw: str | None, n_neurons: int, ffn_roles: list[dict[str, str]], path: str) -> ExpertLayout | None:
    """None for a dense store; else the `experts` field {"count": E, "size": m}, E * m == n_neurons, every weight
    role of every layer naming its experts with EXPERT_FIELD. FormatError naming the field otherwise."""
    if raw is None:
        return None
    field = "__metadata__.experts"
    spec = json_field(raw, field, path)
    ok = isinstance(spec, dict) and set(spec) == {"count", "size"}
    if not ok or any(type(spec[k]) is not int or spec[k] <= 0 for k in spec):
        raise FormatError(field, f"must be {{'count': E > 0, 'size': m > 0}}, got {str(spec)[:80]}", path)
    if spec["count"] * spec["size"] != n_neurons:
        raise FormatError(field, f"{spec['count']} experts of {spec['size']} neurons != n_neurons {n_neurons}", path)
    for layer, roles in enumerate(ffn_roles):
        if any(role not in WEIGHT_ROLES or EXPERT_FIELD not in name for role, name in roles.items()):
            raise FormatError(
                f"__metadata__.ffn_roles[{layer}]", f"an MoE layer's roles must be expert weights, got {roles}", path
            )
    return ExpertLayout(spec["count"], spec["size"])


def parse_neuron_order(
    raw: str | None, n_layers: int, n_neurons: int, experts: ExpertLayout | None, path: str
) -> torch.Tensor | None:
    """None for a store in the model's neuron order; else the `neuron_order` field: per layer the model neuron each
    bundle row holds (row r of layer l = neuron order[l][r]), int64 [n_layers, n_neurons], every layer a
    permutation. FormatError naming the field otherwise (and for an MoE store: its rows are whole experts)."""
    if raw is None:
        return None
    field = "__metadata__.neuron_order"
    if experts is not None:
        raise FormatError(field, "an MoE store keeps each expert's rows together: it takes no neuron order", path)
    order = json_field(raw, field, path)
    try:
        order = torch.tensor(order, dtype=torch.long)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise FormatError(field, "must be a list of per-layer lists of neuron ids", path) from None
    problem = neuron_order_problem(order, n_layers, n_neurons)
    if problem is not None:
        raise FormatError(field, problem, path)
    return order


def neuron_order_problem(order: torch.Tensor, n_layers: int, n_neurons: int) -> str | None:
    """What is wrong with a neuron order for n_layers layers of n_neurons (None: it is one permutation per layer)."""
    if tuple(order.shape) != (n_layers, n_neurons):
        return f"shape {tuple(order.shape)}, expected {(n_layers, n_neurons)}"
    bad = (order.long().sort(dim=1).values != torch.arange(n_neurons)).any(dim=1).nonzero().flatten()
    return None if not len(bad) else f"layer {int(bad[0])} is not a permutation of the {n_neurons} neuron ids"


def layer_tensor_name(layer: int) -> str:
    return f"layers.{layer}.bundles"


def layer_specs(
    layer: int, ffn: int, width: int, dtype: torch.dtype, endor_nnz: int | None, quantized_row_bytes: int | None = None
) -> list[TensorSpec]:
    """The tensors of one layer in bundles.safetensors: dense bundles, quantized bundles (uint8 rows of
    `quantized_row_bytes`), or the Endor rows and row offsets (rows holding `endor_nnz` values; -1 where the reader
    does not know it yet)."""
    name = layer_tensor_name(layer)
    if quantized_row_bytes is not None:
        return [TensorSpec(name, "U8", (ffn, quantized_row_bytes))]
    if endor_nnz is None:
        return [TensorSpec(name, dtype_name(dtype), (ffn, width))]
    rows_bytes = -1 if endor_nnz < 0 else ffn * ((width + 7) // 8) + endor_nnz * dtype.itemsize
    return [TensorSpec(f"{name}.rows", "U8", (rows_bytes,)), TensorSpec(f"{name}.row_offsets", "I64", (ffn + 1,))]


def check_magic(meta: dict[str, str], path: str) -> None:
    """FormatError unless a header carries the store's magic and a version this library reads."""
    if meta.get("magic") != MAGIC:
        raise FormatError("__metadata__.magic", f"expected {MAGIC!r}, got {meta.get('magic')!r}", path)
    if meta.get("format_version") not in READABLE_VERSIONS:
        raise FormatError(
            "__metadata__.format_version",
            f"unsupported version {meta.get('format_version')!r} (this library reads {READABLE_VERSIONS})",
            path,
        )


def parse_resident_formats(raw: str | None, resident: dict[str, TensorEntry], path: str) -> dict[str, tuple[str, int]]:
    """Resident weights held as GGUF blocks (a quantized store's linears and embeddings): name -> (block format,
    columns), each a uint8 tensor [rows, its row bytes]. FormatError naming the field otherwise."""
    field = "__metadata__.resident_formats"
    if raw is None:
        return {}
    formats = json_field(raw, field, path)
    if not isinstance(formats, dict):
        raise FormatError(field, "must map tensor names to [format, columns]", path)
    out = {}
    for name, spec in formats.items():
        where = f"{field}[{name!r}]"
        ok = isinstance(spec, list) and len(spec) == 2 and spec[0] in BLOCK_FORMATS and type(spec[1]) is int
        if not ok or spec[1] <= 0:
            raise FormatError(where, f"must be [one of {tuple(BLOCK_FORMATS)}, columns > 0], got {spec!r}", path)
        entry = resident.get(name)
        width = BLOCK_FORMATS[spec[0]].row_bytes(spec[1])
        if entry is None or entry.dtype != "U8" or len(entry.shape) != 2 or entry.shape[1] != width:
            raise FormatError(
                where,
                f"{name!r} is not a resident uint8 tensor [rows, {width}] ({spec[0]} rows of {spec[1]})",
                path,
            )
        out[name] = (spec[0], spec[1])
    return out


def parse_bundle_format(meta: dict[str, str], endor: bool, path: str) -> BundleFormat | None:
    """None for float bundles; the quantized layout otherwise (never with Endor compression)."""
    name = meta.get("bundle_format", DENSE_FORMAT if meta.get("format_version") == "2" else None)
    if name == DENSE_FORMAT:
        return None
    try:
        bundle_format = BundleFormat.parse(name if isinstance(name, str) else "")
    except ValueError as e:
        raise FormatError("__metadata__.bundle_format", f"{name!r}: {e}", path) from None
    if endor:
        raise FormatError("__metadata__.bundle_format", f"{name!r} with Endor compression", path)
    return bundle_format


def parse_ffn_roles(
    raw: str | None,
    n_layers: int,
    glu: bool,
    hidden_size: int,
    n_neurons: int,
    resident: dict[str, TensorEntry],
    path: str,
) -> list[dict[str, str]]:
    """Per layer, role -> checkpoint tensor name: the weight roles of this model exactly, bias roles only for
    resident tensors of the right shape ([n_neurons] before the activation, [hidden_size] after down)."""
    field = "__metadata__.ffn_roles"
    roles = json_field(raw, field, path) if raw is not None else None
    if not isinstance(roles, list) or len(roles) != n_layers:
        raise FormatError(
            field,
            f"must list the roles of each of the {n_layers} layers, got {str(roles)[:80]}",
            path,
        )
    weights = {"up", "down"} | ({"gate"} if glu else set())
    for layer, names in enumerate(roles):
        where = f"{field}[{layer}]"
        if not isinstance(names, dict) or not all(isinstance(v, str) for v in names.values()):
            raise FormatError(where, "must map roles to tensor names", path)
        unknown = set(names) - set(WEIGHT_ROLES) - set(BIAS_ROLES)
        if unknown or weights - set(names) or set(names) & set(WEIGHT_ROLES) - weights:
            raise FormatError(
                where,
                f"roles {sorted(names)}: needs exactly the weights {sorted(weights)} and biases among {BIAS_ROLES}",
                path,
            )
        for role in set(names) & set(BIAS_ROLES):
            entry = resident.get(names[role])
            size = hidden_size if role == "down_bias" else n_neurons
            if entry is None or entry.shape != (size,):
                raise FormatError(
                    f"{where}.{role}",
                    f"{names[role]!r} is not a resident tensor of shape ({size},)",
                    path,
                )
    return roles


def parse_tensor_sources(raw: str | None, ffn_roles: list[dict[str, str]], path: str) -> list[dict[str, str]] | None:
    """A quantized store's record of how each FFN weight reached it, per layer role -> path ("kept Q4_0 blocks",
    "requantized Q6_K -> q8_0", "quantized F16 -> q4_0"); None where the converter wrote none (float stores)."""
    if raw is None:
        return None
    field = "__metadata__.tensor_sources"
    sources = json_field(raw, field, path)
    weights = [{role for role in names if role in WEIGHT_ROLES} for names in ffn_roles]
    if (
        not isinstance(sources, list)
        or len(sources) != len(ffn_roles)
        or any(not isinstance(layer, dict) or set(layer) != roles for layer, roles in zip(sources, weights))
        or any(not isinstance(path, str) for layer in sources for path in layer.values())
    ):
        raise FormatError(field, f"must map each layer's weight roles to a string, got {str(sources)[:80]}", path)
    return sources


def int_field(meta: dict[str, str], key: str, path: str) -> int:
    """A non-negative integer metadata field; FormatError naming it otherwise."""
    try:
        value = int(meta[key])
    except (KeyError, ValueError):
        raise FormatError(f"__metadata__.{key}", f"missing or not an integer: {meta.get(key)!r}", path) from None
    if value < 0:
        raise FormatError(f"__metadata__.{key}", f"must be non-negative, got {value}", path)
    return value


def check_entry(entries: dict[str, TensorEntry], spec: TensorSpec, alignment: int, path: str) -> None:
    """FormatError unless the header holds `spec` with its dtype and shape, aligned."""
    entry = entries.get(spec.name)
    if entry is None:
        raise FormatError(spec.name, "missing", path)
    # Endor values have a data-dependent length (declared as -1 here); everything else is fixed by metadata.
    shape_ok = len(entry.shape) == 1 if spec.shape == (-1,) else entry.shape == spec.shape
    if entry.dtype != spec.dtype or not shape_ok:
        raise FormatError(
            f"{spec.name}.shape",
            f"{entry.dtype}{list(entry.shape)}, expected {spec.dtype}{list(spec.shape)}",
            path,
        )
    if entry.begin % alignment:
        raise FormatError(
            f"{spec.name}.data_offsets",
            f"starts at byte {entry.begin}, not a multiple of the {alignment}-byte alignment",
            path,
        )
