"""Checkpoint files as other tools write them (a GGUF laid out as llama.cpp writes Llama models), and safetensors
headers rewritten in place (a store that lies about itself)."""

import json
import struct
from pathlib import Path

import gguf
import numpy as np
from transformers import LlamaForCausalLM

_GGUF_BLOCK = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def rewrite_header(path: Path, mutate) -> None:
    """Apply mutate(header dict) to a safetensors header in place, keeping its length (space padding)."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    mutate(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= size
    path.write_bytes(raw[:8] + text + b" " * (size - len(text)) + raw[8 + size :])


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # The rule of llama.cpp's convert_hf_to_gguf.py, written independently of the code under test.
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    parts = hf.split(".")
    module = ".".join(parts[3:5]) if parts[3] in ("self_attn", "mlp") else parts[3]
    return f"blk.{parts[2]}.{_GGUF_BLOCK[module]}.weight"


def random_blocks(shape: tuple[int, int], qtype: gguf.GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    """Random valid blocks uint8 [rows, row_bytes] of a type gguf cannot quantize: Q6_K (per 256 weights: 128 bytes
    of low bits, 64 of high bits, 16 int8 scales, then the float16 scale d, set finite here)."""
    if qtype != gguf.GGMLQuantizationType.Q6_K:
        raise ValueError(f"no random blocks of {qtype.name}")
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    blocks = np.random.default_rng(seed).integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    blocks[..., 208:210] = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def _encode(array: np.ndarray, qtype: gguf.GGMLQuantizationType) -> tuple[np.ndarray, object]:
    """(data, raw_dtype) of a 2-D weight for GGUFWriter.add_tensor."""
    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F64):
        return array.astype(np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float64), None
    try:
        return gguf.quants.quantize(array, qtype), qtype
    except NotImplementedError:
        return random_blocks(array.shape, qtype), qtype


def write_tiny_gguf(
    path: Path,
    model: LlamaForCausalLM,
    qtype=gguf.GGMLQuantizationType.F32,
    arch: str = "llama",
    drop: tuple[str, ...] = (),
    transpose: tuple[str, ...] = (),
    qtypes: dict[str, gguf.GGMLQuantizationType] | None = None,
    **fields: int,
) -> Path:
    """A GGUF laid out as llama.cpp writes Llama models (Q/K rows permuted, 2-D weights quantized to qtype).
    `qtypes` replaces qtype for some kinds of weight (GGUF names: {"ffn_up": Q4_1, "ffn_down": Q8_0}); a type gguf
    cannot quantize (Q6_K) is written as random blocks (random_blocks), not the model's weights, and F64 as float64.
    `fields` replace the model's values of the size fields (block_count=10**9: a header that lies)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    sizes = {
        "block_count": cfg.num_hidden_layers,
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "head_count": cfg.num_attention_heads,
        "head_count_kv": cfg.num_key_value_heads,
        **fields,
    }
    for key, value in sizes.items():
        getattr(writer, f"add_{key}")(value)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" or name in drop:
            continue
        array = tensor.numpy()
        if ".q_proj." in name:
            array = llama_cpp_permute(array, cfg.num_attention_heads)
        elif ".k_proj." in name:
            array = llama_cpp_permute(array, cfg.num_key_value_heads)
        if name in transpose:
            array = np.ascontiguousarray(array.T)
        target = _gguf_name(name)
        if array.ndim == 2:
            array, raw_dtype = _encode(array, (qtypes or {}).get(target.split(".")[-2], qtype))
            writer.add_tensor(target, array, raw_dtype=raw_dtype)
        else:
            writer.add_tensor(target, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
