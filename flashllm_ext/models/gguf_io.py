"""Read Llama-architecture GGUF files: a Hugging Face style config and fp32 tensors under Hugging Face names.

The tensors equal what `transformers` loads from the same file: both dequantize with `gguf.quants.dequantize`,
and llama.cpp's rotary permutation of the Q/K rows is undone here as transformers undoes it.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import FormatError

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama",)
# GGUF name inside a block -> Hugging Face name inside `model.layers.{i}`.
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Errors the gguf reader raises on malformed or truncated files (it indexes a memmap with header values).
_READER_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, struct.error)


def _open(path: str | os.PathLike):
    import gguf

    path = os.fspath(path)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise FormatError("magic", f"expected {GGUF_MAGIC!r}, got {magic!r}: not a GGUF file", path)
    try:
        return gguf.GGUFReader(path)
    except _READER_ERRORS as e:
        raise FormatError("header", f"unreadable GGUF header ({type(e).__name__}: {e})", path) from None


def _field(reader, key: str, path: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise FormatError(key, "missing from the GGUF metadata", path)
        return default
    try:
        return field.contents()
    except _READER_ERRORS as e:
        raise FormatError(key, f"unreadable value ({e})", path) from None


def _config_from_reader(reader, path: str) -> dict[str, Any]:
    arch = _field(reader, "general.architecture", path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise FormatError("general.architecture", f"{arch!r} is not supported (only {SUPPORTED_ARCHITECTURES})",
                          path)
    hidden = int(_field(reader, f"{arch}.embedding_length", path))
    heads = int(_field(reader, f"{arch}.attention.head_count", path))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size", path, default=len(tokens.data) if tokens is not None else None)
    names = {t.name for t in reader.tensors}
    config = {
        "model_type": arch,
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length", path)),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count", path)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", path, default=heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", path, default=hidden // max(1, heads))),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", path)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", path, default=10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", path)),
        "vocab_size": int(vocab),
        "hidden_act": "silu",
        # llama.cpp drops output.weight when the LM head shares the embedding matrix.
        "tie_word_embeddings": "output.weight" not in names,
    }
    for key, name in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id",
                                                                          "eos_token_id")):
        if key in reader.fields:
            config[name] = int(_field(reader, key, path))
    if heads <= 0 or hidden % heads or config["num_attention_heads"] % config["num_key_value_heads"]:
        raise FormatError(f"{arch}.attention.head_count", f"{heads} heads / {config['num_key_value_heads']} kv "
                          f"heads do not divide hidden size {hidden}", path)
    return config


def gguf_config(path: str | os.PathLike) -> dict[str, Any]:
    """Hugging Face style config (model_type, hidden_size, intermediate_size, num_hidden_layers, ...) of a GGUF."""
    return _config_from_reader(_open(path), os.fspath(path))


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape [out, in] (or [n] for norms) for a Llama config."""
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    per_layer = {"self_attn.q_proj": (q_rows, hidden), "self_attn.k_proj": (kv_rows, hidden),
                 "self_attn.v_proj": (kv_rows, hidden), "self_attn.o_proj": (hidden, q_rows),
                 "mlp.gate_proj": (ffn, hidden), "mlp.up_proj": (ffn, hidden), "mlp.down_proj": (hidden, ffn),
                 "input_layernorm": (hidden,), "post_attention_layernorm": (hidden,)}
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{name}.weight": shape for name, shape in per_layer.items()})
    return shapes


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.ffn_up.weight` -> `model.layers.3.mlp.up_proj.weight`; None for names outside the Llama layout."""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    return None


def _undo_rotary_permutation(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp interleaves the two rotary halves of each head's rows; Hugging Face keeps them as two blocks.
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def load_gguf(path: str | os.PathLike, progress: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of a Llama GGUF dequantized to fp32 under its Hugging Face name, Q/K rows un-permuted.

    Raises FormatError (naming the file and the field) for a non-GGUF file, an unsupported architecture,
    unknown, missing or wrongly shaped tensors.
    """
    import gguf

    path = os.fspath(path)
    reader = _open(path)
    config = _config_from_reader(reader, path)
    shapes = expected_shapes(config)
    out: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc=f"dequantizing {Path(path).name}", disable=not progress, unit="t"):
        name = hf_name(tensor.name)
        if name is None or name not in shapes:
            raise FormatError(tensor.name, "tensor has no place in the Llama layout of this config", path)
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except (*_READER_ERRORS, NotImplementedError) as e:
            raise FormatError(tensor.name, f"cannot dequantize {tensor.tensor_type.name} data ({e})", path) from None
        if tuple(array.shape) != shapes[name]:
            raise FormatError(tensor.name, f"shape {tuple(array.shape)}, expected {shapes[name]} for {name}", path)
        if array.dtype != np.float32 or not array.flags.writeable:
            array = array.astype(np.float32)
        weight = torch.from_numpy(array)
        if name.endswith("self_attn.q_proj.weight"):
            weight = _undo_rotary_permutation(weight, config["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            weight = _undo_rotary_permutation(weight, config["num_key_value_heads"])
        out[name] = weight
    missing = [name for name in shapes if name not in out]
    if missing:
        raise FormatError(missing[0], f"missing tensor ({len(missing)} missing in all)", path)
    return out
