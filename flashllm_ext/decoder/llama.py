"""The Llama family on the lean decoder: Llama 2/3, Mistral, Qwen2, Qwen3 and SmolLM (RMSNorm, RoPE, grouped-query
attention; Qwen2's q/k/v biases, Qwen3's per-head q/k norms, Mistral's and Qwen's sliding windows), and the
mixture-of-experts families on the same attention: Mixtral, Qwen2-MoE (a shared expert), Qwen3-MoE and OLMoE (one q
norm and one k norm over all heads), whose FFN is the experts their layer's router names (flashllm_ext.decoder.moe
routes, flashllm_ext.flash.experts reads and computes them).

A layer: x += o(attention(rope(q), rope(k), v)) of rms_norm(x), then x += ffn(rms_norm(x)), with q, k and v one
fused matrix (one read of the three), exactly the arithmetic of transformers' LlamaDecoderLayer in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from flashllm_ext.decoder.config import DecoderConfig, rope_inverse_frequencies
from flashllm_ext.decoder.kv_cache import StaticKVCache
from flashllm_ext.decoder.moe import Router, SharedExpert
from flashllm_ext.ops.blocks import QuantizedWeight
from flashllm_ext.decoder.layers import (
    ResidentWeights,
    attention_projections,
    cached_attention,
    Rotary,
    embedding_rows,
    linear,
    move_tensors,
)

FFN = Callable[[torch.Tensor], torch.Tensor]
DECODER_ATTENTION = torch.ops.flashllm.decoder_attention.default  # the op itself (flashllm_ext/ops/decoder.py)


Projection = tuple[torch.Tensor, str | None, torch.Tensor | None]


def fused_projections(layer: LlamaLayer) -> tuple[Projection, Projection] | None:
    """The layer's (weight, its block format or None, bias) of qkv and of o as flashllm::decoder_attention takes
    them, where both weights are resident (float tensors of one dtype, or blocks, whose bias goes as float32); None
    where a token's attention runs op by op (an offloaded or Endor weight; blocks off the CPU, where the op is its
    reference, which would dequantize them whole: op by op, flashllm::quantized_linear's CUDA kernel reads them)."""
    parts = []
    for w, bias in ((layer.qkv, layer.qkv_bias), (layer.o, layer.o_bias)):
        if isinstance(w, QuantizedWeight) and w.blocks.device.type == "cpu":
            parts.append((w.blocks, w.fmt, bias if bias is None or bias.dtype == torch.float32 else bias.float()))
        elif isinstance(w, torch.Tensor):
            parts.append((w, None, bias))
        else:
            return None
    if parts[0][1] is None and parts[1][1] is None and parts[0][0].dtype != parts[1][0].dtype:
        return None
    return parts[0], parts[1]


class LlamaLayer:
    """One decoder layer's resident weights (attention and norms) and its forward."""

    def __init__(self, config: DecoderConfig, weights: ResidentWeights, index: int):
        attn = f"layers.{index}.self_attn."
        self.qkv, self.qkv_bias, self.o, self.o_bias = attention_projections(config, weights, attn)
        # a bias beside blocks goes to the kernels as float32: cast once here, not every token
        if isinstance(self.qkv, QuantizedWeight) and self.qkv_bias is not None:
            self.qkv_bias = self.qkv_bias.float()
        if isinstance(self.o, QuantizedWeight) and self.o_bias is not None:
            self.o_bias = self.o_bias.float()
        self.attention_norm = weights.require(f"layers.{index}.input_layernorm.weight", torch.float32)
        self.ffn_norm = weights.require(f"layers.{index}.post_attention_layernorm.weight", torch.float32)
        self.q_norm = self.k_norm = None
        if config.qk_norm or config.full_qk_norm:
            self.q_norm = weights.require(f"{attn}q_norm.weight", torch.float32)
            self.k_norm = weights.require(f"{attn}k_norm.weight", torch.float32)
        self.full_qk_norm = config.full_qk_norm
        # an MoE layer's router and shared expert (its experts are the FFN's: flashllm_ext.flash.experts)
        self.router = Router(config, weights, index) if config.n_experts else None
        self.shared_expert = SharedExpert(config, weights, index) if config.shared_expert else None
        self.index, self.window, self.eps = index, config.windows[index], config.norm_eps
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.scale = config.head_dim**-0.5

    def tensors(self) -> list[torch.Tensor | None]:
        norms = [self.attention_norm, self.ffn_norm, self.q_norm, self.k_norm]
        moe = [t for part in (self.router, self.shared_expert) if part is not None for t in part.tensors()]
        return [self.qkv, self.qkv_bias, self.o, self.o_bias, *norms, *moe]

    def ffn_input(self, x: torch.Tensor) -> torch.Tensor:
        """What this layer's FFN would see if the attention added nothing (a look-ahead predictor's input)."""
        return F.rms_norm(x, self.ffn_norm.shape, self.ffn_norm, self.eps)

    def __call__(
        self,
        x: torch.Tensor,
        ffn: FFN,
        cache: StaticKVCache,
        rotary: Rotary,
        tables: tuple[torch.Tensor, torch.Tensor],
        before_ffn: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """x [T, d] float32 (the tokens after the cache's `length`) -> the layer's output [T, d]; tables: the
        rotary's for these tokens (Rotary.tables). before_ffn(x): called with the residual after the attention,
        before the FFN (an MoE decoder's read-ahead of the next layer's experts)."""
        n_tokens, start = x.shape[0], cache.length
        # decoding: the attention half in one call, which also norms the FFN's input (resident matrices only)
        fused = fused_projections(self) if n_tokens == 1 and not self.full_qk_norm else None
        if fused is not None:
            (qkv, qkv_format, qkv_bias), (o, o_format, o_bias) = fused
            x, h = DECODER_ATTENTION(
                x,
                self.attention_norm,
                qkv,
                qkv_bias,
                self.q_norm,
                self.k_norm,
                tables[0],
                tables[1],
                *cache.layers[self.index],
                o,
                o_bias,
                self.ffn_norm,
                start,
                self.window or 0,
                self.eps,
                self.scale,
                qkv_format,
                o_format,
            )
            if before_ffn is not None:
                before_ffn(x)
            return x + ffn(h)
        h = F.rms_norm(x, self.attention_norm.shape, self.attention_norm, self.eps)
        qkv = linear(h, self.qkv, self.qkv_bias)
        head_norms = None if self.q_norm is None else (self.q_norm, self.k_norm, self.eps)
        if self.full_qk_norm:  # OLMoE: q and k normed over all heads, before the per-head view
            q_end, k_end = self.n_heads * self.head_dim, (self.n_heads + self.n_kv_heads) * self.head_dim
            q = F.rms_norm(qkv[:, :q_end], self.q_norm.shape, self.q_norm, self.eps)
            k = F.rms_norm(qkv[:, q_end:k_end], self.k_norm.shape, self.k_norm, self.eps)
            qkv, head_norms = torch.cat((q, k, qkv[:, k_end:]), dim=1), None
        heads = (self.n_heads, self.n_kv_heads, self.head_dim)
        out = cached_attention(qkv, cache, self.index, heads, rotary, tables, self.window, self.scale, head_norms)
        x = x + linear(out, self.o, self.o_bias)
        if before_ffn is not None:
            before_ffn(x)
        return x + ffn(self.ffn_input(x))


class LlamaModel:
    """Embedding, layers, final norm and LM head of a Llama-family model, from the store's resident tensors."""

    def __init__(self, config: DecoderConfig, weights: ResidentWeights, max_len: int):
        self.embedding = weights.require("embed_tokens.weight")
        self.layers = [LlamaLayer(config, weights, i) for i in range(config.n_layers)]
        self.norm = weights.require("norm.weight", torch.float32)
        head = weights.get("lm_head.weight")
        if head is None and not config.tie_embeddings:
            raise ValueError(f"{weights.store.path}: no lm_head.weight and the config does not tie it to the embedding")
        self.head = self.embedding if head is None else head
        self.rotary = Rotary(rope_inverse_frequencies(config), max_len)
        self.eps = config.norm_eps

    def tensors(self) -> list[torch.Tensor | None]:
        own = [self.embedding, self.norm, self.head, self.rotary.cos, self.rotary.sin]
        return own + [t for layer in self.layers for t in layer.tensors()]

    def to(self, device: torch.device) -> LlamaModel:
        move_tensors(self, device)
        for layer in self.layers:
            for part in (layer, layer.router, layer.shared_expert):
                if part is not None:
                    move_tensors(part, device)
        move_tensors(self.rotary, device)
        return self

    def embed(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """ids [T] at positions start.. -> float32 [T, d]."""
        return embedding_rows(self.embedding, ids)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, d] -> float32 [T, vocab]."""
        return linear(F.rms_norm(x, self.norm.shape, self.norm, self.eps), self.head)
