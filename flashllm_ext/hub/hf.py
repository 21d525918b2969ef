"""The `transformers` reference model for a GGUF file, weight replacement and Linear-input capture."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from flashllm_ext.hub.fetch import fetch_default
from flashllm_ext.ops.blocks import QuantizedWeight
from flashllm_ext.ops.linear import quantized_matmul

FFN_KINDS = ("gate_proj", "up_proj", "down_proj")


def ffn_linear_names(num_layers: int) -> list[str]:
    """Module names of every FFN Linear: `model.layers.{i}.mlp.{gate,up,down}_proj`, layer-major."""
    return [f"model.layers.{i}.mlp.{kind}" for i in range(num_layers) for kind in FFN_KINDS]


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The decoder layers of a Hugging Face causal LM: model.model.layers (Llama family) or
    model.model.decoder.layers (OPT); None for other layouts."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None and getattr(inner, "decoder", None) is not None:
        layers = getattr(inner.decoder, "layers", None)
    return layers


def ffn_norm(layer: nn.Module) -> nn.Module:
    """The norm a decoder layer applies to its residual stream before its FFN (Llama's post_attention_layernorm,
    OPT's final_layer_norm; Identity for an OPT that normalises after the FFN instead), so that norm(the layer's
    input) is the FFN input the layer would see if attention added nothing: what a look-ahead predictor scores."""
    if hasattr(layer, "post_attention_layernorm"):
        return layer.post_attention_layernorm
    if hasattr(layer, "final_layer_norm"):
        return layer.final_layer_norm if getattr(layer, "do_layer_norm_before", True) else nn.Identity()
    raise ValueError(f"{type(layer).__name__}: no post_attention_layernorm (Llama) or final_layer_norm (OPT)")


def load_hf_model(path: str | os.PathLike | None = None, state_dict: Mapping[str, torch.Tensor] | None = None):
    """(model, tokenizer) loaded offline by `transformers` from a GGUF file (default: the default model) or a
    Hugging Face checkpoint directory (tokenizer None where it has none).

    The model is fp32, in eval mode. `state_dict` (Hugging Face names -> tensors, any subset) replaces those
    weights after loading, e.g. pruned FFN matrices.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path) if path is not None else fetch_default()
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
        has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True) if has_tokenizer else None
    elif path.is_file():
        kwargs = {"gguf_file": path.name, "local_files_only": True}
        model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, **kwargs)
    else:
        raise FileNotFoundError(f"no GGUF file or checkpoint directory at {path}")
    if state_dict:
        replace_weights(model, state_dict)
    return model.eval(), tokenizer


def save_hf_checkpoint(model: torch.nn.Module, tokenizer, path: str | os.PathLike) -> None:
    """Write a model loaded from GGUF (load_hf_model) as a plain fp16 Hugging Face safetensors directory with its
    tokenizer. transformers refuses to serialise a GGUF-loaded model, so its weights go into a fresh one first."""
    from transformers import AutoModelForCausalLM

    config = model.config
    config.__dict__.pop("quantization_config", None)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(path)
    tokenizer.save_pretrained(path)


@torch.no_grad()
def replace_weights(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy tensors into the model's parameters of the same names (cast to the parameter's dtype).

    Raises ValueError for a name the model does not have or a shape that differs, before changing anything.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, value in state_dict.items():
        if name not in params:
            raise ValueError(f"model has no parameter {name!r}")
        if tuple(value.shape) != tuple(params[name].shape):
            raise ValueError(f"{name}: shape {tuple(value.shape)} differs from the model's {tuple(params[name].shape)}")
    for name, value in state_dict.items():
        params[name].copy_(value)


@torch.inference_mode()
def collect_linear_inputs(
    model: torch.nn.Module, input_ids: torch.Tensor, module_names: Iterable[str]
) -> dict[str, torch.Tensor]:
    """Inputs seen by the named Linear modules during one forward pass of `input_ids` ([T] or [B, T]).

    Returns module name -> fp32 [B*T, in_features]. Hooks are removed afterwards, even on error.
    """
    captured: dict[str, list[torch.Tensor]] = {}
    handles = []

    def hook_for(name: str):
        def hook(module: torch.nn.Module, args: tuple, _output: torch.Tensor) -> None:
            captured[name].append(args[0].detach().reshape(-1, args[0].shape[-1]).float())

        return hook

    try:
        for name in module_names:
            captured[name] = []
            handles.append(model.get_submodule(name).register_forward_hook(hook_for(name)))
        model(input_ids.view(1, -1) if input_ids.dim() == 1 else input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return {name: torch.cat(chunks) for name, chunks in captured.items()}


def empty_model(config: dict, dtype: torch.dtype, source: str | os.PathLike) -> nn.Module:
    """A Hugging Face causal LM of a store's `config` (a checkpoint's config.json fields) with its parameters on the
    meta device (buffers real), to be filled by assign_resident; `source` names the store in errors."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(config)
    model_type = config.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"{source}: the store's config has no model_type")
    hf_config = AutoConfig.for_model(model_type, **config)
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(hf_config, dtype=dtype)


def refuse_missing_tensors(model: nn.Module, store) -> None:
    """ValueError naming the parameters still on the meta device after the store's tensors were assigned."""
    leftover = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if leftover:
        raise ValueError(f"{store.path}: the store has no tensor for {leftover[:3]} ({len(leftover)} in all)")


# Module paths of checkpoints older than the modules transformers 5 builds -> its own (Mixtral's MoE block)
NAME_ALIASES = ((".block_sparse_moe.", ".mlp."),)


class QuantizedEmbedding(nn.Module):
    """An nn.Embedding whose weight stays in GGUF blocks: a lookup dequantizes only the rows it reads, to `dtype`."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("blocks", weight.blocks)
        self.fmt, self.embedding_dim, self.dtype = weight.fmt, weight.cols, dtype

    @property
    def quantized(self) -> QuantizedWeight:
        return QuantizedWeight(self.blocks, self.fmt, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] int -> [..., embedding_dim] of dtype."""
        return self.quantized.rows(ids.reshape(-1)).to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.blocks.shape[0]}, {self.embedding_dim}, {self.fmt}"


class QuantizedLinear(nn.Module):
    """An nn.Linear whose weight stays in GGUF blocks, multiplied as stored (ops.quantized_linear); bias [out] or
    None."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("blocks", weight.blocks)
        self.register_buffer("bias", bias)
        self.fmt, self.in_features, self.out_features = weight.fmt, weight.cols, weight.blocks.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features] of x's dtype."""
        bias = None if self.bias is None else self.bias.float()
        return quantized_matmul(x, QuantizedWeight(self.blocks, self.fmt, self.in_features), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}"


def assign_resident(model: nn.Module, store, dtype: torch.dtype, keep_blocks: bool = False) -> None:
    """Load the store's resident tensors into the (meta) model under their names; tie the LM head if the
    checkpoint shares it with the embedding. `store`: anything with `path`, `resident_names()`,
    `resident_tensor(name)` (and `resident_weight(name)`, for keep_blocks), `close_resident()` and `resident_path`
    (a FlashStore, an offload LayerStore). keep_blocks: an embedding the store holds as GGUF blocks becomes a
    QuantizedEmbedding over them, and a linear layer's (the attention's projections, the LM head) a QuantizedLinear
    (a tied LM head shares the embedding's blocks); any other resident tensor is loaded as floats in `dtype`."""
    params = dict(model.named_parameters(remove_duplicate=False))
    ends = {"input": model.get_input_embeddings(), "output": model.get_output_embeddings()}
    kept, linears = {}, {}  # the embeddings' blocks; the other linear layers' (module name -> blocks)
    for name in store.resident_names():
        if name.startswith("predictor."):
            continue
        aliases = [name] + [name.replace(old, new) for old, new in NAME_ALIASES if old in name]
        target = next((t for a in aliases for t in (a, f"model.{a}") if t in params), None)
        if target is None:
            raise ValueError(f"{store.path}: resident tensor {name!r} has no place in {type(model).__name__}")
        module_name, _, attr = target.rpartition(".")
        module = model.get_submodule(module_name)
        end = next((k for k, m in ends.items() if m is module and attr == "weight"), None)
        blocks_fit = attr == "weight" and (end is not None or type(module) is nn.Linear)
        value = store.resident_weight(name) if keep_blocks and blocks_fit else store.resident_tensor(name)
        if tuple(value.shape) != tuple(params[target].shape):
            raise ValueError(
                f"{store.path}: {name} has shape {tuple(value.shape)}, the model expects {tuple(params[target].shape)}"
            )
        if isinstance(value, QuantizedWeight) and end is not None:
            kept[end] = value
        elif isinstance(value, QuantizedWeight):
            linears[module_name] = value
        else:
            setattr(module, attr, nn.Parameter(value.to(dtype), requires_grad=False))
    for module_name, weight in linears.items():  # after the loop: their biases are in place by now
        parent, _, child = module_name.rpartition(".")
        bias = model.get_submodule(module_name).bias
        if bias is not None and bias.device.type == "meta":
            raise ValueError(f"{store.path}: the store has no tensor for {module_name}.bias")
        model.get_submodule(parent).register_module(child, QuantizedLinear(weight, None if bias is None else bias.data))
    tied = getattr(model.config, "tie_word_embeddings", False)
    if "input" in kept:
        model.set_input_embeddings(QuantizedEmbedding(kept["input"], dtype))
        if tied and "output" not in kept:
            kept["output"] = kept["input"]
    if "output" in kept:
        model.set_output_embeddings(QuantizedLinear(kept["output"]))
    elif tied:
        model.tie_weights()
    # Every resident tensor is a copy of its own, read without a mapping (io.safetensors.ResidentFile).
    store.close_resident()
