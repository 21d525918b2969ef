"""Hugging Face-format checkpoints of synthesized weights with the shapes of real 7B models, for the scale runs.

    synthesize_checkpoint("opt-6.7b", out_dir, prune=0.5)      # OPT-6.7B: ReLU FFN, d 4096, 16384 neurons
    synthesize_checkpoint("llama-2-7b", out_dir)               # Llama-2-7B: SwiGLU FFN, d 4096, 11008 neurons

A checkpoint is what `save_pretrained` writes: config.json, safetensors shards and model.safetensors.index.json,
loadable by `transformers.AutoModelForCausalLM.from_pretrained` and convertible by `flashllm_ext.flash.convert`. The
tensor names and shapes are those of a `transformers` model built from the config on the meta device (tied weights
written once, as save_pretrained does), so nothing here restates a family's naming scheme. Written one tensor at a
time (the largest, the embedding, is ~0.4 GB in fp16): the model is never in memory.

Weights are random (normal, std 0.02; norms 1, biases 0): a flash store's read sizes, read counts and compute do not
depend on weight values, so naive/hybrid/flash speeds measured on them are those of the real model with the same
active sets (the active sets of the scale run come from the default model, bench/traces.py). `prune` zeroes that
fraction of every decoder-layer Linear weight per output row, smallest magnitudes first: the layout of a Wanda or
magnitude-pruned checkpoint (with random weights Wanda's |W| * ||X|| order is the magnitude order up to the input
norms), which changes what Endor compression stores, not what flash reads.

`vocab_size` replaces the model's vocabulary size. llama.cpp runs a checkpoint with a tokenizer of exactly as many
tokens as the embedding has rows, and none of Llama-2-7B's 32000 is stored here: vocab_size=49152 gives a Llama-2-7B
shape checkpoint the default model's tokenizer, which `flashllm_ext.harness.llama_cpp.write_llama_gguf` copies into
its GGUF. Its embedding and LM head then have 49152 rows, not Llama-2-7B's 32000: 140 M more parameters (0.28 GB in
fp16), the decoder layers unchanged.

    synthesize_checkpoint("llama-2-7b", out_dir, vocab_size=49152)

The shared copies on this machine (written once by `python -m bench.synth_checkpoint`, ~13 GB each):
    ~/.cache/flashllm_ext/scale/opt-6.7b-hf      OPT-6.7B shapes, prune=0.5 (fp16)
    ~/.cache/flashllm_ext/scale/llama-2-7b-hf    Llama-2-7B shapes, dense (fp16)
and with `--vocab-size N` a copy of its own, e.g. ~/.cache/flashllm_ext/scale/llama-2-7b-vocab49152-hf.

`synthesize_gguf` writes a Llama GGUF of quantized random weights instead, as llama.cpp's quantized files are laid
out (what `flashllm convert --dtype q4` reads at scale); `python -m bench.synth_checkpoint llama-3-8b --gguf q4_0`:
    ~/.cache/flashllm_ext/scale/llama-3-8b.Q4_0.gguf   Llama-3-8B shapes, every 2-D weight Q4_0 (4.5 GB)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
from pathlib import Path

import torch
from tqdm.auto import tqdm

from flashllm_ext.io.gguf_layout import expected_shapes, gguf_name
from flashllm_ext.io.paths import resolve_cache_dir, staged_file
from flashllm_ext.io.safetensors import AlignedWriter, TensorSpec, dtype_name
from flashllm_ext.flash.store import DTYPES
from flashllm_ext.ops.blocks import BLOCK, BLOCK_FORMATS, block_format, quantize_rows

# The published config.json of facebook/opt-6.7b and meta-llama/Llama-2-7b-hf (architecture fields).
CONFIGS: dict[str, dict] = {
    "opt-6.7b": {
        "model_type": "opt",
        "architectures": ["OPTForCausalLM"],
        "activation_function": "relu",
        "hidden_size": 4096,
        "ffn_dim": 16384,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "vocab_size": 50272,
        "word_embed_proj_dim": 4096,
        "max_position_embeddings": 2048,
        "do_layer_norm_before": True,
        "enable_bias": True,
        "layer_norm_elementwise_affine": True,
        "bos_token_id": 2,
        "eos_token_id": 2,
        "pad_token_id": 1,
        "tie_word_embeddings": True,
    },
    "llama-2-7b": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    },
    "llama-3-8b": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "tie_word_embeddings": False,
    },
    # the mixture-of-experts shapes (allenai/OLMoE-1B-7B-0924, Qwen/Qwen3-30B-A3B)
    "olmoe-1b-7b": {
        "model_type": "olmoe",
        "architectures": ["OlmoeForCausalLM"],
        "hidden_act": "silu",
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "vocab_size": 50304,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": None,
        "eos_token_id": 50279,
        "pad_token_id": 1,
        "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_act": "silu",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "tie_word_embeddings": False,
    },
}
# name -> (dir, prune) of the shared Hugging Face checkpoints (the GGUF ones: shared_gguf)
SHARED_DIRS = {
    "opt-6.7b": ("opt-6.7b-hf", 0.5),
    "llama-2-7b": ("llama-2-7b-hf", None),
    "olmoe-1b-7b": ("olmoe-1b-7b-hf", None),
    "qwen3-30b-a3b": ("qwen3-30b-a3b-hf", None),
}
_SMOKE_MOE = {  # 8 experts of 64 neurons, 2 a token
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 100,
    "max_position_embeddings": 64,
}
# The smoke shapes of each family (a benchmark's --smoke, the tests): every code path of the real shapes, ~0.4 MB a
# layer, so that a share of the model still holds the resident tensors and two layer buffers (bench_offload's 30%).
SMOKE_OVERRIDES = {
    "opt-6.7b": {
        "hidden_size": 128,
        "ffn_dim": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 100,
        "word_embed_proj_dim": 128,
        "max_position_embeddings": 64,
    },
    "llama-2-7b": {
        "hidden_size": 128,
        "intermediate_size": 352,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 100,
        "max_position_embeddings": 64,
    },
    "olmoe-1b-7b": {**_SMOKE_MOE, "intermediate_size": 64},
    "qwen3-30b-a3b": {**_SMOKE_MOE, "moe_intermediate_size": 64, "head_dim": 32},
}
INIT_STD = 0.02
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_specs(config: dict, dtype: torch.dtype) -> list[TensorSpec]:
    """Every tensor a `transformers` model of `config` saves (tied weights once), in its parameter order."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(config)
    hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    # named_parameters drops the second name of a tied weight (lm_head.weight of OPT): save_pretrained does too.
    tensors = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if n in model.state_dict()]
    specs = []
    for name, t in tensors:
        specs.extend(_expert_specs(name, tuple(t.shape)) or [(name, tuple(t.shape))])
    return [TensorSpec(name, dtype_name(dtype), shape) for name, shape in specs]


def _expert_specs(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]] | None:
    """A module's fused expert parameter ([E, 2m, d] gate_up_proj, [E, d, m] down_proj: how transformers holds
    experts in memory) as save_pretrained writes it, one weight per expert and role (the published checkpoints'
    layout: mlp.experts.{e}.gate_proj.weight ...); None for any other parameter."""
    prefix, _, kind = name.rpartition(".")
    if not prefix.endswith(".experts") or kind not in ("gate_up_proj", "down_proj"):
        return None
    count = shape[0]
    if kind == "down_proj":
        return [(f"{prefix}.{e}.down_proj.weight", shape[1:]) for e in range(count)]
    size = shape[1] // 2
    return [(f"{prefix}.{e}.{role}_proj.weight", (size, shape[2])) for e in range(count) for role in ("gate", "up")]


def _is_pruned(spec: TensorSpec) -> bool:
    """Decoder-layer Linear weights: what Wanda prunes (not embeddings, norms, biases or the LM head)."""
    return ".layers." in spec.name and spec.name.endswith(".weight") and len(spec.shape) == 2


def synth_tensor(spec: TensorSpec, generator: torch.Generator, prune: float | None) -> torch.Tensor:
    """One synthesized tensor: norms (1-D `*norm*.weight`) 1, biases 0, else normal(0, INIT_STD); decoder-layer
    weights with `prune` of each row's smallest magnitudes zeroed."""
    dtype = DTYPES[{"F16": "fp16", "BF16": "bf16", "F32": "fp32"}[spec.dtype]]
    if len(spec.shape) == 1:
        fill = 1.0 if "norm" in spec.name and spec.name.endswith(".weight") else 0.0
        return torch.full(spec.shape, fill, dtype=dtype)
    weight = torch.randn(spec.shape, generator=generator, dtype=torch.float32).mul_(INIT_STD)
    if prune and _is_pruned(spec):
        k = int(prune * spec.shape[1])  # zeroed per row
        if k:
            magnitude = weight.abs()
            cut = magnitude.kthvalue(k, dim=1, keepdim=True).values
            weight.masked_fill_(magnitude <= cut, 0.0)
    return weight.to(dtype)


def synthesize_checkpoint(
    name: str,
    out_dir: str | os.PathLike,
    *,
    prune: float | None = None,
    dtype: str = "fp16",
    seed: int = 0,
    overrides: dict | None = None,
    vocab_size: int | None = None,
    shard_bytes: int = 2 << 30,
    progress: bool = True,
) -> Path:
    """Write a Hugging Face checkpoint with the shapes of `name` ("opt-6.7b" or "llama-2-7b"; `overrides` replaces
    config fields, e.g. a tiny config for tests; `vocab_size`, the vocabulary size, the embedding's [vocab_size,
    hidden] rows and the LM head's, see the module doc) at `out_dir`: config.json, safetensors shards of at most
    `shard_bytes` (a larger tensor gets a shard of its own) and model.safetensors.index.json. Written under a
    temporary name and renamed at the end; an existing `out_dir` is replaced. Returns out_dir."""
    if name not in CONFIGS:
        raise ValueError(f"name must be one of {sorted(CONFIGS)}, got {name!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if prune is not None and not 0.0 <= prune < 1.0:
        raise ValueError(f"prune must be in [0, 1), got {prune}")
    if vocab_size is not None and vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    config = {**CONFIGS[name], **(overrides or {}), "torch_dtype": str(DTYPES[dtype]).removeprefix("torch.")}
    if vocab_size is not None:
        config["vocab_size"] = vocab_size
    specs = checkpoint_specs(config, DTYPES[dtype])
    shards: list[list[TensorSpec]] = [[]]
    for spec in specs:
        if shards[-1] and sum(s.nbytes for s in shards[-1]) + spec.nbytes > shard_bytes:
            shards.append([])
        shards[-1].append(spec)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    try:
        with tqdm(
            total=sum(s.nbytes for s in specs),
            unit="B",
            unit_scale=True,
            disable=not progress,
            desc=f"synthesizing {name}" + (f" (pruned {prune:g})" if prune else ""),
        ) as bar:
            for index, shard in enumerate(shards):
                file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
                with AlignedWriter(tmp / file, shard, {"format": "pt"}, alignment=8, tensor_alignment=1) as writer:
                    for spec in shard:
                        writer.write(spec.name, synth_tensor(spec, generator, prune))
                        weight_map[spec.name] = file
                        bar.update(spec.nbytes)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / INDEX_FILE).write_text(
            json.dumps({"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": weight_map}, indent=2)
            + "\n"
        )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def shared_checkpoint_path(
    name: str, layers: int | None = None, smoke: bool = False, vocab_size: int | None = None
) -> Path:
    """Where shared_checkpoint keeps `name` with these options (written or not)."""
    directory, _ = SHARED_DIRS[name]
    if layers is not None and layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    stem = (
        directory.removesuffix("-hf")
        + (f"-vocab{vocab_size}" if vocab_size is not None else "")
        + ("-smoke" if smoke else "")
        + (f"-{layers}layers" if layers else "")
    )
    return resolve_cache_dir() / "scale" / f"{stem}-hf"


def shared_checkpoint(
    name: str, progress: bool = True, layers: int | None = None, smoke: bool = False, vocab_size: int | None = None
) -> Path:
    """The shared copy of `name` under the cache's scale/ directory (see the module doc), written if missing.
    layers: only the first that many decoder layers (a shorter run of the same shapes, e.g. within a lent GPU's
    minutes), in a directory of its own; smoke: SMOKE_OVERRIDES' shapes instead (with `layers`, that many);
    vocab_size: that vocabulary size (e.g. 49152, the default model's tokenizer), in a directory of its own."""
    _, prune = SHARED_DIRS[name]
    path = shared_checkpoint_path(name, layers, smoke, vocab_size)
    if not (path / INDEX_FILE).is_file():
        overrides = {**(SMOKE_OVERRIDES[name] if smoke else {}), **({"num_hidden_layers": layers} if layers else {})}
        synthesize_checkpoint(name, path, prune=prune, overrides=overrides, vocab_size=vocab_size, progress=progress)
    return path


def synthesize_gguf(
    name: str,
    path: str | os.PathLike,
    *,
    qtype: str = "q4_0",
    seed: int = 0,
    overrides: dict | None = None,
    progress: bool = True,
) -> Path:
    """Write a Llama GGUF with the shapes of `name` (a Llama model of CONFIGS; `overrides` replaces config fields)
    at `path`, laid out as llama.cpp writes a quantized one: every tensor flashllm_ext.io.checkpoint expects under
    llama.cpp's names, 2-D weights normal(0, INIT_STD) in `qtype` blocks (q8_0, q4_0 or q4_1; quantized by
    flashllm_ext.ops.blocks, bit for bit what gguf's numpy quantizer writes, many times faster), norms F32 ones.
    The size fields are written, and a placeholder vocabulary of vocab_size tokens (synthetic_vocabulary) so that
    llama.cpp, which refuses a model without one, loads it: prompts are token ids. One tensor in memory at a time (the largest, a [vocab, hidden]
    matrix, 0.3 GB in q4_0), written under a temporary name and renamed; an existing file is replaced."""
    import gguf
    import numpy as np

    config = {**CONFIGS[name], **(overrides or {})} if name in CONFIGS else None
    if config is None or config["model_type"] != "llama":
        raise ValueError(f"name must be a Llama model among {sorted(CONFIGS)}, got {name!r}")
    fmt = block_format(qtype)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    shapes = expected_shapes({"head_dim": hidden // heads, **config})
    raw_dtype = gguf.GGMLQuantizationType(fmt.ggml_type)
    file_type = {"q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0", "q4_1": "MOSTLY_Q4_1"}[fmt.name]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    with staged_file(path) as tmp:
        writer = gguf.GGUFWriter(str(tmp), "llama")
        writer.add_name(name)
        writer.add_context_length(config["max_position_embeddings"])
        writer.add_embedding_length(hidden)
        writer.add_block_count(config["num_hidden_layers"])
        writer.add_feed_forward_length(config["intermediate_size"])
        writer.add_rope_dimension_count(hidden // heads)
        writer.add_head_count(heads)
        writer.add_head_count_kv(config["num_key_value_heads"])
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
        writer.add_rope_freq_base(config["rope_theta"])
        writer.add_file_type(gguf.LlamaFileType[file_type])
        writer.add_vocab_size(config["vocab_size"])
        add_placeholder_tokenizer(writer, config["vocab_size"])
        for hf, shape in shapes.items():
            if len(shape) == 2:
                nbytes = shape[0] * fmt.row_bytes(shape[1])
                writer.add_tensor_info(gguf_name(hf), (shape[0], nbytes // shape[0]), np.uint8, nbytes, raw_dtype)
            else:
                writer.add_tensor_info(gguf_name(hf), shape, np.float32, shape[0] * 4)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        total = sum(math.prod(shape) for shape in shapes.values())
        with tqdm(
            total=total, unit="w", unit_scale=True, disable=not progress, desc=f"synthesizing {path.name}"
        ) as bar:
            for shape in shapes.values():
                if len(shape) == 1:
                    writer.write_tensor_data(np.ones(shape, dtype=np.float32))
                    bar.update(shape[0])
                    continue
                rows, cols = shape
                blocks = torch.empty((rows, fmt.row_bytes(cols)), dtype=torch.uint8)
                step = max(1, (64 << 20) // (4 * cols))  # 64 MB of float32 weights at a time
                for start in range(0, rows, step):
                    stop = min(start + step, rows)
                    weight = torch.randn((stop - start, cols), generator=generator).mul_(INIT_STD)
                    blocks[start:stop] = quantize_rows(weight, fmt.name)
                    bar.update((stop - start) * cols)
                writer.write_tensor_data(blocks.numpy())
        writer.close()
    return path


# model_type -> llama.cpp's architecture of the MoE checkpoints write_moe_gguf writes
MOE_GGUF_ARCHITECTURES = {"olmoe": "olmoe", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama"}
# model_type -> (its experts' module, their gate / up / down weight names)
_MOE_EXPERTS = {
    "olmoe": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    "qwen2_moe": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe.experts", ("w1", "w3", "w2")),
}
# Hugging Face name within a decoder layer -> llama.cpp's, for the tensors of an MoE layer that are not experts
_MOE_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",  # Qwen2-MoE's
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",  # Mixtral's router
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",  # Qwen2-MoE's shared expert
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
}


def write_moe_gguf(
    checkpoint_dir: str | os.PathLike,
    dst: str | os.PathLike,
    expert_type: str | None = None,
    progress: bool = True,
    per_expert: bool = False,
) -> Path:
    """An F16 GGUF at `dst` of an OLMoE, Qwen2-MoE, Qwen3-MoE or Mixtral checkpoint (synthesize_checkpoint's, or save_pretrained's),
    laid out as llama.cpp's converter writes those models: each layer's experts stacked into ffn_gate_exps /
    ffn_up_exps [E, m, d] and ffn_down_exps [E, d, m], the router ffn_gate_inp, norms and the router float32, q and k
    as they are for OLMoE and Qwen3-MoE (llama.cpp rotates them NeoX-style, as transformers does) and in llama.cpp's
    rotary order for Mixtral (a "llama" file), and the placeholder vocabulary (synthetic_vocabulary).
    expert_type (a flashllm_ext.ops.blocks format, e.g. "q4_0"): the experts in those blocks, as a quantized file holds
    them (round to nearest), the rest F16. per_expert: each expert's weights a tensor of its own,
    blk.{i}.ffn_{gate,up,down}.{e}.weight, as Mixtral files were written before llama.cpp fused them. One layer's
    experts in memory at a time; written under a temporary name and renamed."""
    import gguf
    import numpy as np

    from flashllm_ext.io.checkpoint import open_checkpoint
    from flashllm_ext.io.gguf_layout import rotary_permutation

    ckpt = open_checkpoint(checkpoint_dir)
    config = ckpt.config
    arch = MOE_GGUF_ARCHITECTURES.get(config.get("model_type"))
    if arch is None:
        raise ValueError(
            f"{checkpoint_dir}: model_type {config.get('model_type')!r} is not among {MOE_GGUF_ARCHITECTURES}"
        )
    n_layers = int(config["num_hidden_layers"])
    n_experts = int(config.get("num_experts") or config["num_local_experts"])  # (transformers 5 writes the latter)
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    size = int(config.get("moe_intermediate_size") or config["intermediate_size"])
    # (llama.cpp name, numpy shape, float32?, the tensor): the experts of a layer one stacked tensor per role
    plan: list[tuple[str, tuple[int, ...], bool, object]] = []
    for name, target in (("model.embed_tokens.weight", "token_embd"), ("model.norm.weight", "output_norm")):
        plan.append((f"{target}.weight", ckpt.shape(name), len(ckpt.shape(name)) == 1, name))
    if "lm_head.weight" in ckpt.names:
        plan.append(("output.weight", ckpt.shape("lm_head.weight"), False, "lm_head.weight"))
    for i in range(n_layers):
        for suffix, target in _MOE_LAYER_NAMES.items():
            name = f"model.layers.{i}.{suffix}"
            if name in ckpt.names:
                f32 = len(ckpt.shape(name)) == 1 or target == "ffn_gate_inp.weight"
                plan.append((f"blk.{i}.{target}", ckpt.shape(name), f32, name))
        module, weights = _MOE_EXPERTS[config["model_type"]]
        for role, weight in zip(("gate", "up", "down"), weights):
            names = [f"model.layers.{i}.{module}.{e}.{weight}.weight" for e in range(n_experts)]
            if per_expert:
                plan += [(f"blk.{i}.ffn_{role}.{e}.weight", ckpt.shape(n), False, [n]) for e, n in enumerate(names)]
            else:
                plan.append((f"blk.{i}.ffn_{role}_exps.weight", (n_experts, *ckpt.shape(names[0])), False, names))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    rotary = {"attn_q": heads, "attn_k": kv_heads} if arch == "llama" else {}  # llama.cpp's order of q/k rows
    path = Path(dst)
    with staged_file(path) as tmp:
        writer = gguf.GGUFWriter(str(tmp), arch)
        writer.add_name(Path(checkpoint_dir).name)
        writer.add_context_length(int(config["max_position_embeddings"]))
        writer.add_embedding_length(hidden)
        writer.add_block_count(n_layers)
        writer.add_feed_forward_length(int(config["intermediate_size"]))
        writer.add_expert_feed_forward_length(size)
        writer.add_expert_count(n_experts)
        writer.add_expert_used_count(int(config["num_experts_per_tok"]))
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(int(config["shared_expert_intermediate_size"]))
        writer.add_head_count(heads)
        writer.add_head_count_kv(kv_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(head_dim)
        # (transformers 5 writes rope_theta inside rope_parameters)
        rope = config.get("rope_parameters") or {}
        writer.add_rope_freq_base(float(rope.get("rope_theta") or config.get("rope_theta", 10000.0)))
        writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        writer.add_vocab_size(int(config["vocab_size"]))
        add_placeholder_tokenizer(writer, int(config["vocab_size"]))
        fmt = None if expert_type is None else block_format(expert_type)
        for target, shape, f32, source in plan:
            if fmt is not None and isinstance(source, list):  # quantized experts: uint8 rows of blocks
                if shape[-1] % BLOCK:
                    raise ValueError(f"{checkpoint_dir}: {target} rows of {shape[-1]} are not whole {BLOCK}-blocks")
                nbytes = math.prod(shape[:-1]) * fmt.row_bytes(shape[-1])
                raw = gguf.GGMLQuantizationType(fmt.ggml_type)
                writer.add_tensor_info(target, (*shape[:-1], fmt.row_bytes(shape[-1])), np.uint8, nbytes, raw)
                continue
            dtype = np.dtype(np.float32 if f32 else np.float16)
            writer.add_tensor_info(target, shape, dtype, math.prod(shape) * dtype.itemsize)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for target, shape, f32, source in tqdm(plan, desc=f"writing {path.name}", unit="t", disable=not progress):
            if not isinstance(source, list):
                tensor = ckpt[source]
                heads_of = rotary.get(target.split(".")[2]) if target.startswith("blk.") else None
                if heads_of:
                    tensor = rotary_permutation(tensor, heads_of)
                writer.write_tensor_data(tensor.to(torch.float32 if f32 else torch.float16).contiguous().numpy())
                continue
            experts = torch.stack([ckpt[n] for n in source]).view(shape)
            if fmt is None:
                writer.write_tensor_data(experts.half().numpy())
            else:
                blocks = quantize_rows(experts.reshape(-1, shape[-1]).float(), fmt.name)
                writer.write_tensor_data(blocks.view(*shape[:-1], -1).numpy())
        writer.close()
    return path


def add_placeholder_tokenizer(writer, size: int) -> None:
    """The GGUF tokenizer fields of synthetic_vocabulary(size) (a SentencePiece-style "llama" model, ids 0-2 the
    unknown, begin and end tokens) on a gguf.GGUFWriter."""
    tokens, types = synthetic_vocabulary(size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def placeholder_tokenizer_gguf(size: int) -> Path:
    """A GGUF of no tensors holding the placeholder vocabulary of `size` tokens (add_placeholder_tokenizer), under
    the cache's scale/ directory, written once: the tokenizer llama_cpp.write_llama_gguf gives a synthesized
    checkpoint's F16 GGUF."""
    import gguf

    path = resolve_cache_dir() / "scale" / f"placeholder-tokenizer-{size}.gguf"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with staged_file(path) as tmp:
        writer = gguf.GGUFWriter(str(tmp), "llama")
        add_placeholder_tokenizer(writer, size)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return path


def synthetic_vocabulary(size: int) -> tuple[list[str], list[int]]:
    """(tokens, gguf token types) of a SentencePiece-style vocabulary of `size` placeholder tokens: <unk>, <s>, </s>,
    the 256 byte tokens where `size` leaves room (llama.cpp's loader looks up the newline's), then "t<i>"."""
    import gguf

    if size < 3:
        raise ValueError(f"vocab_size must be at least 3 for the placeholder vocabulary, got {size}")
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    if size >= 3 + 256:
        tokens += [f"<0x{b:02X}>" for b in range(256)]
        types += [gguf.TokenType.BYTE] * 256
    tokens += [f"t{i}" for i in range(len(tokens), size)]
    types += [gguf.TokenType.NORMAL] * (size - len(types))
    return tokens, [int(t) for t in types]


def shared_gguf(name: str, qtype: str = "q4_0", progress: bool = True) -> Path:
    """The shared GGUF of `name` in `qtype` blocks under the cache's scale/ directory (see the module doc), written
    if missing."""
    path = resolve_cache_dir() / "scale" / f"{name}.{qtype.upper()}.gguf"
    if not path.is_file():
        synthesize_gguf(name, path, qtype=qtype, progress=progress)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "names", nargs="*", help=f"among {sorted(CONFIGS)} (default: the shared checkpoints, {sorted(SHARED_DIRS)})"
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        help="vocabulary size in place of the model's (49152: the default model's tokenizer), in a directory of its own",
    )
    parser.add_argument(
        "--gguf",
        choices=tuple(BLOCK_FORMATS),
        help="write a Llama GGUF of the model's shapes in these blocks instead (synthesize_gguf, shared_gguf)",
    )
    args = parser.parse_args(argv)
    if args.gguf and args.vocab_size:
        parser.error("--vocab-size applies to Hugging Face checkpoints, not to --gguf")
    for name in args.names or sorted(SHARED_DIRS):
        if args.gguf:
            print(shared_gguf(name, args.gguf))
        else:
            print(shared_checkpoint(name, vocab_size=args.vocab_size))


if __name__ == "__main__":
    main()
