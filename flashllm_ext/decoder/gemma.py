"""Gemma 2 and Gemma 3 (text) on the lean decoder: the Llama family's grouped-query attention and RoPE with Gemma's
differences, each as transformers computes it in float32:

- RMSNorm scales by (1 + weight) (the stored weight is an offset from one), folded into the weight once here;
- sandwich norms: the attention's and the FFN's outputs are normed again before they join the residual;
- the embedding is scaled by sqrt(hidden_size), rounded to the weights' dtype as transformers rounds it;
- attention scale query_pre_attn_scalar ** -0.5; Gemma 2 soft-caps the attention scores and the final logits;
- local (sliding-window) and global layers alternate; Gemma 3's local layers rotate with their own RoPE base, and
  it norms each head of q and k (as Qwen3);
- the FFN is GeGLU: gelu_tanh(gate x) * (up x), served by any engine mode like every other family's.

A layer: x += post_norm(o(attention(rope(q), rope(k), v))) of norm(x), then x += post_ffn_norm(ffn(pre_ffn_norm(x))).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from flashllm_ext.decoder.config import DecoderConfig, rope_inverse_frequencies
from flashllm_ext.decoder.kv_cache import StaticKVCache
from flashllm_ext.decoder.layers import (
    ResidentWeights,
    attention_projections,
    cached_attention,
    Rotary,
    embedding_rows,
    linear,
    move_tensors,
    soft_cap,
)
from flashllm_ext.ops.blocks import QuantizedWeight

FFN = Callable[[torch.Tensor], torch.Tensor]


def _norm_weight(weights: ResidentWeights, name: str) -> torch.Tensor:
    """A Gemma RMSNorm's effective float32 scale, 1 + the stored weight."""
    return weights.require(name, torch.float32) + 1.0


class GemmaLayer:
    """One decoder layer's resident weights (attention, its four norms) and its forward."""

    def __init__(self, config: DecoderConfig, weights: ResidentWeights, index: int, local_rotary: Rotary | None):
        prefix, attn = f"layers.{index}.", f"layers.{index}.self_attn."
        self.qkv, self.qkv_bias, self.o, self.o_bias = attention_projections(config, weights, attn)
        norms = (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        )
        self.attention_norm, self.attention_out_norm, self.ffn_norm, self.ffn_out_norm = (
            _norm_weight(weights, f"{prefix}{name}.weight") for name in norms
        )
        self.q_norm = _norm_weight(weights, f"{attn}q_norm.weight") if config.qk_norm else None
        self.k_norm = _norm_weight(weights, f"{attn}k_norm.weight") if config.qk_norm else None
        self.window = config.windows[index]
        # Gemma 3's local layers rotate with their own base; Gemma 2's every layer with the model's
        self.local_rotary = local_rotary if self.window is not None else None
        self.index, self.eps, self.softcap = index, config.norm_eps, config.attention_softcap
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.scale = config.attention_scale

    def tensors(self) -> list[torch.Tensor | None]:
        norms = [self.attention_norm, self.attention_out_norm, self.ffn_norm, self.ffn_out_norm, self.q_norm]
        return [self.qkv, self.qkv_bias, self.o, self.o_bias, *norms, self.k_norm]

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, self.eps)

    def ffn_input(self, x: torch.Tensor) -> torch.Tensor:
        """What this layer's FFN would see if the attention added nothing (a look-ahead predictor's input)."""
        return self._rms_norm(x, self.ffn_norm)

    def __call__(
        self,
        x: torch.Tensor,
        ffn: FFN,
        cache: StaticKVCache,
        rotary: Rotary,
        tables: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """x [T, d] float32 (the tokens after the cache's `length`) -> the layer's output [T, d]; tables: the
        global rotary's for these tokens (a local layer of Gemma 3 takes its own)."""
        if self.local_rotary is not None:
            rotary, tables = self.local_rotary, self.local_rotary.tables(cache.length, x.shape[0])
        qkv = linear(self._rms_norm(x, self.attention_norm), self.qkv, self.qkv_bias)
        head_norms = None if self.q_norm is None else (self.q_norm, self.k_norm, self.eps)
        heads = (self.n_heads, self.n_kv_heads, self.head_dim)
        out = cached_attention(
            qkv, cache, self.index, heads, rotary, tables, self.window, self.scale, head_norms, self.softcap
        )
        x = x + self._rms_norm(linear(out, self.o, self.o_bias), self.attention_out_norm)
        return x + self._rms_norm(ffn(self.ffn_input(x)), self.ffn_out_norm)


class GemmaModel:
    """Embedding, layers, final norm and (tied) LM head of a Gemma 2 or Gemma 3 text model."""

    def __init__(self, config: DecoderConfig, weights: ResidentWeights, max_len: int):
        self.embedding = weights.require("embed_tokens.weight")
        self.embed_scale = config.hidden_size**0.5
        self.rotary = Rotary(rope_inverse_frequencies(config), max_len)
        self.local_rotary = (
            None if config.local_rope_theta is None else Rotary(rope_inverse_frequencies(config, local=True), max_len)
        )
        self.layers = [GemmaLayer(config, weights, i, self.local_rotary) for i in range(config.n_layers)]
        self.norm = _norm_weight(weights, "norm.weight")
        head = weights.get("lm_head.weight")
        if head is None and not config.tie_embeddings:
            raise ValueError(f"{weights.store.path}: no lm_head.weight and the config does not tie it to the embedding")
        self.head = self.embedding if head is None else head
        self.eps, self.logit_softcap = config.norm_eps, config.logit_softcap

    def tensors(self) -> list[torch.Tensor | None]:
        own = [self.embedding, self.norm, self.head, self.rotary.cos, self.rotary.sin]
        if self.local_rotary is not None:
            own += [self.local_rotary.cos, self.local_rotary.sin]
        return own + [t for layer in self.layers for t in layer.tensors()]

    def to(self, device: torch.device) -> GemmaModel:
        move_tensors(self, device)
        for rotary in (self.rotary, self.local_rotary):
            if rotary is not None:
                move_tensors(rotary, device)
        for layer in self.layers:
            move_tensors(layer, device)
        return self

    def embed(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """ids [T] at positions start.. -> float32 [T, d], scaled by sqrt(d) in the weights' dtype as transformers
        scales them (a quantized embedding: in float32)."""
        if isinstance(self.embedding, QuantizedWeight):
            return embedding_rows(self.embedding, ids) * self.embed_scale
        scale = torch.tensor(self.embed_scale, dtype=self.embedding.dtype)
        return (self.embedding[ids] * scale).float()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, d] -> float32 [T, vocab], soft-capped where the config caps them (Gemma 2)."""
        logits = linear(F.rms_norm(x, self.norm.shape, self.norm, self.eps), self.head)
        return soft_cap(logits, self.logit_softcap)
