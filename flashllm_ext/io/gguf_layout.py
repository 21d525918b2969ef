"""What a GGUF file's names and metadata mean in Hugging Face terms: the reader opened with clear errors, the config
from its key-values (Llama, and the mixture-of-experts Mixtral, OLMoE, Qwen2-MoE and Qwen3-MoE), every tensor's expected shape,
tensor names both ways (a fused expert tensor as each expert's rows), and llama.cpp's rotary row order of Q/K.
flashllm_ext.io.checkpoint's GGUFCheckpoint reads the tensors by these names."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flashllm_ext.errors import FormatError
from flashllm_ext.io.paths import regular_file

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama", "olmoe", "qwen2moe", "qwen3moe")  # llama with experts: Mixtral
# GGUF name inside a block -> Hugging Face name inside `model.layers.{i}`.
BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
ATTENTION_NAMES = {k: v for k, v in BLOCK_NAMES.items() if not k.startswith(("ffn_gate", "ffn_up", "ffn_down"))}


@dataclass(frozen=True)
class MoEFamily:
    """How an MoE family's layer is named and built: its Hugging Face class, router and experts' module, the roles
    of llama.cpp's fused expert tensors, its q/k norms ("whole": one over all heads, "head": per head, None), and
    Qwen2-MoE's q/k/v biases and shared expert."""

    architecture: str
    router: str
    experts: str
    roles: dict[str, str]
    qk_norm: str | None
    shared_expert: bool = False  # (with the q/k/v biases of its Qwen2 attention)

    def block_names(self) -> dict[str, str]:
        """GGUF name inside a block -> Hugging Face name inside `model.layers.{i}`, fused experts aside."""
        norms = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"} if self.qk_norm else {}
        return {
            **ATTENTION_NAMES,
            **norms,
            "ffn_gate_inp": self.router,
            **(SHARED_EXPERT if self.shared_expert else {}),
        }


# Qwen2-MoE's shared expert: llama.cpp's names -> transformers'
SHARED_EXPERT = {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


GATE_UP_DOWN = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# model_type -> its family; a GGUF's architecture -> its model_type (Mixtral's files are "llama" with experts)
MOE_FAMILIES = {
    "olmoe": MoEFamily("OlmoeForCausalLM", "mlp.gate", "mlp.experts", GATE_UP_DOWN, "whole"),
    "qwen3_moe": MoEFamily("Qwen3MoeForCausalLM", "mlp.gate", "mlp.experts", GATE_UP_DOWN, "head"),
    "qwen2_moe": MoEFamily("Qwen2MoeForCausalLM", "mlp.gate", "mlp.experts", GATE_UP_DOWN, None, shared_expert=True),
    "mixtral": MoEFamily(
        "MixtralForCausalLM",
        "block_sparse_moe.gate",
        "block_sparse_moe.experts",
        {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"},
        None,
    ),
}
MOE_ARCHITECTURES = {"olmoe": "olmoe", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_BLOCK_NAMES = {hf: name for name, hf in BLOCK_NAMES.items()}
GGUF_TOP_NAMES = {hf: name for name, hf in TOP_NAMES.items()}
# Errors the gguf reader raises on malformed or truncated files (it indexes a memmap with header values).
READER_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, struct.error)
# float32 bytes a GGUF tensor is dequantized in at a time: gguf's numpy dequantizers make temporaries several times
# the size of their output, which for a whole 8B-model FFN matrix (235 MB in fp32) is about a gigabyte.
DEQUANTIZE_CHUNK_BYTES = 32 << 20


def open_reader(path: str | os.PathLike):
    import gguf

    path = regular_file(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise FormatError("magic", f"expected {GGUF_MAGIC!r}, got {magic!r}: not a GGUF file", path)
    try:
        return gguf.GGUFReader(path)
    except READER_ERRORS as e:
        raise FormatError("header", f"unreadable GGUF header ({type(e).__name__}: {e})", path) from None


def _field(reader, key: str, path: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise FormatError(key, "missing from the GGUF metadata", path)
        return default
    try:
        return field.contents()
    except READER_ERRORS as e:
        raise FormatError(key, f"unreadable value ({e})", path) from None


def _size(reader, key: str, path: str, default: int | None = None) -> int:
    """A positive integer field: sizes size the model built from them, and a zero divides."""
    value = _field(reader, key, path, default)
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
        raise FormatError(key, f"must be positive, got {value!r}", path)
    return int(value)


def config_from_reader(reader, path: str) -> dict[str, Any]:
    arch = _field(reader, "general.architecture", path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise FormatError("general.architecture", f"{arch!r} is not supported (only {SUPPORTED_ARCHITECTURES})", path)
    hidden = _size(reader, f"{arch}.embedding_length", path)
    heads = _size(reader, f"{arch}.attention.head_count", path)
    blocks = _size(reader, f"{arch}.block_count", path)
    moe = MOE_ARCHITECTURES.get(arch, "mixtral" if f"{arch}.expert_count" in reader.fields else None)
    # Every name of every block is built from this count (expected_shapes): a file cannot hold fewer tensors.
    per_block = len(BLOCK_NAMES) if moe is None else len(MOE_FAMILIES[moe].block_names()) + 3
    if blocks * per_block > len(reader.tensors):
        raise FormatError(
            f"{arch}.block_count",
            f"{blocks} blocks need {blocks * per_block} tensors, the file has {len(reader.tensors)}",
            path,
        )
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _size(reader, f"{arch}.vocab_size", path, default=len(tokens.data) if tokens is not None else None)
    names = {t.name for t in reader.tensors}
    config = {
        "model_type": arch,
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": _size(reader, f"{arch}.feed_forward_length", path),
        "num_hidden_layers": blocks,
        "num_attention_heads": heads,
        "num_key_value_heads": _size(reader, f"{arch}.attention.head_count_kv", path, default=heads),
        "head_dim": _size(reader, f"{arch}.attention.key_length", path, default=hidden // heads),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", path)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", path, default=10000.0)),
        "max_position_embeddings": _size(reader, f"{arch}.context_length", path),
        "vocab_size": vocab,
        "hidden_act": "silu",
        # llama.cpp drops output.weight when the LM head shares the embedding matrix.
        "tie_word_embeddings": "output.weight" not in names,
    }
    if moe is not None:
        config.update(_moe_config(reader, arch, moe, path, config["intermediate_size"]))
    for key, name in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        if key in reader.fields:
            config[name] = int(_field(reader, key, path))
    if hidden % heads or config["num_attention_heads"] % config["num_key_value_heads"]:
        raise FormatError(
            f"{arch}.attention.head_count",
            f"{heads} heads / {config['num_key_value_heads']} kv heads do not divide hidden size {hidden}",
            path,
        )
    return config


def _moe_config(reader, arch: str, model_type: str, path: str, intermediate_size: int) -> dict[str, Any]:
    """The Hugging Face config fields of an MoE GGUF: experts, experts a token, their size, whether the chosen
    experts' weights are renormalised (the file's expert_weights_norm, else what llama.cpp does for the family:
    Qwen3-MoE yes, OLMoE and Qwen2-MoE no; Mixtral always), Qwen2-MoE's shared expert's size."""
    size = _size(reader, f"{arch}.expert_feed_forward_length", path, default=intermediate_size)
    norm = _field(reader, f"{arch}.expert_weights_norm", path, default=model_type == "qwen3_moe")
    fields = {
        "model_type": model_type,
        "architectures": [MOE_FAMILIES[model_type].architecture],
        "num_experts": _size(reader, f"{arch}.expert_count", path),
        "num_experts_per_tok": _size(reader, f"{arch}.expert_used_count", path),
        "norm_topk_prob": bool(norm),
    }
    # OLMoE's and Mixtral's experts are intermediate_size wide; Qwen's moe_intermediate_size (intermediate_size:
    # their dense layers', none here)
    fields["moe_intermediate_size" if model_type.startswith("qwen") else "intermediate_size"] = size
    if MOE_FAMILIES[model_type].shared_expert:
        key = f"{arch}.expert_shared_feed_forward_length"
        fields["shared_expert_intermediate_size"] = _size(reader, key, path)
    return fields


def gguf_config(path: str | os.PathLike) -> dict[str, Any]:
    """Hugging Face style config (model_type, hidden_size, intermediate_size, num_hidden_layers, ...) of a GGUF."""
    return config_from_reader(open_reader(path), os.fspath(path))


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape [out, in] (or [n] for norms) for a Llama config, or an OLMoE / Qwen3-MoE
    one (each expert's weights under names of their own, as save_pretrained writes them)."""
    hidden = config["hidden_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    per_layer = {
        "self_attn.q_proj": (q_rows, hidden),
        "self_attn.k_proj": (kv_rows, hidden),
        "self_attn.v_proj": (kv_rows, hidden),
        "self_attn.o_proj": (hidden, q_rows),
        "input_layernorm": (hidden,),
        "post_attention_layernorm": (hidden,),
    }
    per_layer.update(_moe_layer_shapes(config, q_rows, kv_rows) if config.get("num_experts") else _ffn_shapes(config))
    family = MOE_FAMILIES.get(config["model_type"])
    biases = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows} if family and family.shared_expert else {}
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{name}.weight": shape for name, shape in per_layer.items()})
        shapes.update({f"model.layers.{i}.self_attn.{name}.bias": (rows,) for name, rows in biases.items()})
    return shapes


def _ffn_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    return {"mlp.gate_proj": (ffn, hidden), "mlp.up_proj": (ffn, hidden), "mlp.down_proj": (hidden, ffn)}


def _moe_layer_shapes(config: dict[str, Any], q_rows: int, kv_rows: int) -> dict[str, tuple[int, ...]]:
    """An MoE layer's q/k norms (OLMoE's over all heads, Qwen3-MoE's a head, Mixtral none), router and experts."""
    family = MOE_FAMILIES[config["model_type"]]
    hidden, head_dim, experts = config["hidden_size"], config["head_dim"], config["num_experts"]
    size = config.get("moe_intermediate_size") or config["intermediate_size"]
    shapes = {family.router: (experts, hidden)}
    if family.qk_norm:
        whole = family.qk_norm == "whole"
        shapes["self_attn.q_norm"] = (q_rows,) if whole else (head_dim,)
        shapes["self_attn.k_norm"] = (kv_rows,) if whole else (head_dim,)
    if family.shared_expert:
        shared = config["shared_expert_intermediate_size"]
        shapes["mlp.shared_expert_gate"] = (1, hidden)
        shapes["mlp.shared_expert.gate_proj"] = (shared, hidden)
        shapes["mlp.shared_expert.up_proj"] = (shared, hidden)
        shapes["mlp.shared_expert.down_proj"] = (hidden, shared)
    gate, up, down = family.roles.values()
    for e in range(experts):
        shapes[f"{family.experts}.{e}.{gate}"] = (size, hidden)
        shapes[f"{family.experts}.{e}.{up}"] = (size, hidden)
        shapes[f"{family.experts}.{e}.{down}"] = (hidden, size)
    return shapes


def hf_name(gguf_name: str, block_names: dict[str, str] = BLOCK_NAMES) -> str | None:
    """`blk.3.ffn_up.weight` -> `model.layers.3.mlp.up_proj.weight`; None for names outside the Llama layout
    (block_names: an MoE family's, MoEFamily.block_names, for the tensors of its layers other than the experts)."""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in TOP_NAMES:
        return f"{TOP_NAMES[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in block_names:
        return f"model.layers.{parts[1]}.{block_names[parts[2]]}.{parts[3]}"
    return None


def expert_parts(
    gguf_name: str, shape: tuple[int, ...], family: MoEFamily
) -> list[tuple[str, tuple[int, ...], int]] | None:
    """A fused expert tensor (`blk.{i}.ffn_up_exps.weight`, shape [E, rows, cols]) as each expert's Hugging Face
    tensor: (name, [rows, cols], its first row in the fused tensor's [E * rows, cols]); an expert's own tensor of
    the older layout (`blk.{i}.ffn_up.{e}.weight` [rows, cols], Mixtral files written before llama.cpp fused them)
    as that expert's, from row 0; None for any other name."""
    parts = gguf_name.split(".")
    if len(parts) == 5 and parts[0] == "blk" and parts[1].isdigit() and parts[3].isdigit():
        role = family.roles.get(f"{parts[2]}_exps")
        if role is None:
            return None
        return [(f"model.layers.{parts[1]}.{family.experts}.{int(parts[3])}.{role}.{parts[4]}", shape, 0)]
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in family.roles:
        return None
    if len(shape) != 3:
        return [(f"{gguf_name} of shape {shape}", shape, 0)]  # no place in the layout: refused by its name
    experts, rows, cols = shape
    prefix = f"model.layers.{parts[1]}.{family.experts}"
    role = family.roles[parts[2]]
    return [(f"{prefix}.{e}.{role}.weight", (rows, cols), e * rows) for e in range(experts)]


def gguf_name(hf: str) -> str | None:
    """`model.layers.3.mlp.up_proj.weight` -> `blk.3.ffn_up.weight` (the inverse of hf_name); None for names
    outside the Llama layout."""
    module, dot, suffix = hf.rpartition(".")
    if not dot:
        return None
    if module in GGUF_TOP_NAMES:
        return f"{GGUF_TOP_NAMES[module]}.{suffix}"
    parts = module.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and parts[3] in GGUF_BLOCK_NAMES:
        return f"blk.{parts[2]}.{GGUF_BLOCK_NAMES[parts[3]]}.{suffix}"
    return None


def rotary_permutation(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[rows, cols] q_proj or k_proj rows of a Hugging Face checkpoint -> the same rows in llama.cpp's order (its
    converter's `permute` for the llama architecture): each head's two rotary halves interleaved. The exact
    inverse of what GGUFCheckpoint undoes on reading; `n_heads` is the query or the key/value head count."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def undo_rotary_permutation(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp interleaves the two rotary halves of each head's rows; Hugging Face keeps them as two blocks.
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
