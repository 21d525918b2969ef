"""Hugging Face models (Llama family, OPT) decoding with their KV cache on storage.

`generate(model, input_ids, backend, ...)` runs `model.generate` with:
- `StorageKVCache`, a transformers `Cache` whose layers keep no K/V in memory: the prompt's K/V go to the backend
  in bulk (prefill), and each decode step's new k/v are handed to attention unchanged;
- the attention function "storage_kv" (registered with transformers' AttentionInterface): prefill attention is
  transformers' own SDPA over the prompt (the host has the prompt's K/V anyway), each decode step is
  `backend.step(layer, q, k_new, v_new)`: attention near storage (NearStorageAttention), the FlexGen-style
  baseline (HostKVAttention) or the X-cache split (XCacheAttention, which a forward pre-hook on each attention
  module gives the attention input X), all with the same interface.

Batches of different prompt lengths are left-padded (a tokenizer with padding_side="left" and its attention_mask):
the pad tokens' K/V are stored with the prompt (every pair's rows stay one token per step), and the backend is
told each sequence's padding (`set_starts`), so no storage-side softmax ever includes a padded position; the
model's own position ids already skip the padding (generate derives them from the mask).
"""

from __future__ import annotations

import os

import torch
from torch import nn

ATTN_NAME = "storage_kv"  # no "flash" in it: transformers takes such names for flash-attention kernels


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of every decoder layer (Llama family: self_attn; OPT: self_attn)."""
    from flashllm_ext.hub import decoder_layers

    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (Llama family and OPT are supported)")
    return [layer.self_attn for layer in layers]


def attention_shape(model: nn.Module) -> dict:
    """n_layers, q_heads, kv_heads, head_dim and scale (what multiplies q.k in the model's attention call: OPT scales
    q in its projection and calls attention with 1.0)."""
    config = model.config
    q_heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or q_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // q_heads
    scale = 1.0 if config.model_type == "opt" else head_dim**-0.5
    return {
        "n_layers": config.num_hidden_layers,
        "q_heads": q_heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "scale": scale,
    }


def storage_attention(
    model: nn.Module,
    directories: list[str | os.PathLike],
    *,
    batch: int,
    max_tokens: int,
    kind: str = "near_storage",
    dtype: torch.dtype | None = None,
    x_cache: int = 0,
    **kwargs,
):
    """A backend shaped for `model`: kind "near_storage" (NearStorageAttention; kwargs: processes, writeback, link,
    block_tokens, ...) or "baseline" (HostKVAttention). dtype: KV storage dtype (default: the model's).
    x_cache: sequences (the first of the batch) kept as X on the host (XCacheAttention; 0: none)."""
    from flashllm_ext.kv.baseline import HostKVAttention
    from flashllm_ext.kv.near_storage import NearStorageAttention
    from flashllm_ext.kv.xcache import XCacheAttention

    cls = {"near_storage": NearStorageAttention, "baseline": HostKVAttention}.get(kind)
    if cls is None:
        raise ValueError(f"kind must be 'near_storage' or 'baseline', got {kind!r}")
    if not 0 <= x_cache < batch:
        raise ValueError(f"x_cache must be in [0, batch), got {x_cache} of {batch}")
    dtype = dtype or next(model.parameters()).dtype
    storage = cls(
        directories, batch=batch - x_cache, max_tokens=max_tokens, dtype=dtype, **attention_shape(model), **kwargs
    )
    if not x_cache:
        return storage
    return XCacheAttention(
        storage, hf_projector(model), n_x=x_cache, hidden=model.config.hidden_size, max_tokens=max_tokens
    )


def hf_projector(model: nn.Module):
    """K/V of X for `model`'s layers: its k_proj / v_proj (with their biases) and, for the Llama family, the rotary
    embedding of the positions (OPT adds positions to the embeddings instead)."""
    from flashllm_ext.kv.xcache import linear_projector

    modules = attention_modules(model)
    shape = attention_shape(model)
    bias = modules[0].k_proj.bias is not None
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if model.config.model_type != "opt" and rotary is None:
        raise ValueError(f"{type(model).__name__}: no rotary embedding found at model.model.rotary_emb")

    def rope(k: torch.Tensor, start: int | torch.Tensor) -> torch.Tensor:
        """transformers' rotate-half RoPE of k [n, kv_heads, s, head_dim] at positions start.. (start: int, or
        int64 [n] per sequence)."""
        positions = torch.arange(k.shape[2]) + torch.as_tensor(start, dtype=torch.int64).reshape(-1, 1)
        cos, sin = rotary(k, positions)  # [1 or n, s, head_dim]
        cos, sin = cos[:, None].to(k.dtype), sin[:, None].to(k.dtype)
        half = k.shape[-1] // 2
        rotated = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
        return k * cos + rotated * sin

    return linear_projector(
        [m.k_proj.weight for m in modules],
        [m.v_proj.weight for m in modules],
        kv_heads=shape["kv_heads"],
        bk=[m.k_proj.bias for m in modules] if bias else None,
        bv=[m.v_proj.bias for m in modules] if bias else None,
        rope=None if rotary is None or model.config.model_type == "opt" else rope,
    )


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, _attention)
    # the prefill runs transformers' SDPA, so it takes SDPA's mask (padding included; an unknown name gets none)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    """The registered attention function: query [B, Hq, q_len, D], key / value [B, Hkv, q_len, D] (the new tokens
    only: StorageKVCache keeps nothing). Returns (out [B, q_len, Hq, D], None)."""
    backend = getattr(module, "_flashllm_kv_backend", None)
    if backend is None:
        raise RuntimeError(f"{ATTN_NAME} attention on a module without a KV backend: use flashllm_ext.kv.hf.generate")
    if query.shape[2] > 1:  # prefill: dense causal attention over the prompt, exactly as transformers does it
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if scaling is not None and abs(scaling - backend.scale) > 1e-12 * max(1.0, abs(scaling)):
        raise ValueError(f"the model's attention scale {scaling} differs from the backend's {backend.scale}")
    out, _ = backend.step(module.layer_idx, query[:, :, 0], key[:, :, 0], value[:, :, 0])
    return out.to(query.dtype)[:, None], None


def _capture_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
    x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    module._flashllm_kv_backend.set_input(module.layer_idx, x)


def _storage_layer_class():
    from transformers.cache_utils import CacheLayerMixin

    class StorageLayer(CacheLayerMixin):
        """One layer of StorageKVCache: counts tokens, sends the prompt's K/V to the backend, keeps nothing."""

        is_sliding = False
        is_compileable = False

        def __init__(self, backend, layer_idx: int):
            super().__init__()
            self.backend, self.layer_idx, self.length = backend, layer_idx, 0

        def lazy_initialization(self, key_states, value_states) -> None:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = key_states.shape[2]
            if n > 1:
                if self.length:
                    raise ValueError(
                        "StorageKVCache: several tokens after the prompt (chunked prefill, speculative "
                        "decoding) are not supported"
                    )
                self.backend.prefill(self.layer_idx, key_states, value_states)
            self.length += n
            return key_states, value_states

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.length + query_length, 0

        def get_seq_length(self) -> int:
            return self.length

        def get_max_length(self) -> int:
            return -1

        def reset(self) -> None:
            self.length = 0

    return StorageLayer


def storage_cache(backend, n_layers: int):
    """A transformers Cache whose K/V live in `backend` (one StorageLayer per decoder layer)."""
    from transformers.cache_utils import Cache

    layer_class = _storage_layer_class()
    return Cache(layers=[layer_class(backend, i) for i in range(n_layers)])


def left_padding(attention_mask: torch.Tensor | None, shape: torch.Size) -> torch.Tensor | None:
    """The pad tokens in front of each sequence (int64 [batch]) of a left-padded attention_mask [batch, prompt]
    (None or all ones: None). Raises ValueError for right padding, holes, or a sequence of padding only."""
    if attention_mask is None:
        return None
    if tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask must be {list(shape)} like input_ids, got {list(attention_mask.shape)}")
    mask = attention_mask.to(torch.int64)
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask must hold 0 (padding) and 1 (tokens) only")
    starts = (mask == 0).sum(1)
    valid = torch.arange(mask.shape[1])[None] >= starts[:, None]
    if not torch.equal(valid, mask.bool()):
        bad = int((valid != mask.bool()).any(1).nonzero()[0])
        raise ValueError(
            f"sequence {bad}: the padding must all be on the left (tokenizer padding_side='left'), got "
            f"attention_mask {mask[bad].tolist()}"
        )
    if bool((starts == mask.shape[1]).any()):
        raise ValueError(f"sequence {int((starts == mask.shape[1]).nonzero()[0])} is all padding")
    return starts if bool(starts.any()) else None


@torch.no_grad()
def generate(
    model: nn.Module, input_ids: torch.Tensor, backend, *, attention_mask: torch.Tensor | None = None, **generate_kwargs
) -> torch.Tensor:
    """`model.generate(input_ids, ...)` with the KV cache in `backend` (reset first; see storage_attention).
    input_ids [batch, prompt]; attention_mask [batch, prompt] (None: no padding): 0 for the pad tokens, which must
    be on the left (a tokenizer with padding_side="left"). Returns generate's token ids."""
    if input_ids.shape[0] != backend.batch:
        raise ValueError(f"batch of {input_ids.shape[0]} sequences, the backend was made for {backend.batch}")
    starts = left_padding(attention_mask, input_ids.shape)
    _register()
    modules = attention_modules(model)
    previous = model.config._attn_implementation
    backend.reset()
    if starts is not None:
        backend.set_starts(starts)
    hooks = []
    for m in modules:
        m._flashllm_kv_backend = backend
        if hasattr(backend, "set_input"):  # X-cache: the attention input, seen before the K/V it makes
            hooks.append(m.register_forward_pre_hook(_capture_input, with_kwargs=True))
    try:
        model.set_attn_implementation(ATTN_NAME)
        cache = storage_cache(backend, len(modules))
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        return model.generate(input_ids, attention_mask=mask, past_key_values=cache, **generate_kwargs)
    finally:
        model.set_attn_implementation(previous)
        for hook in hooks:
            hook.remove()
        for m in modules:
            del m._flashllm_kv_backend
