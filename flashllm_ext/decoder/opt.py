"""OPT on the lean decoder: learned positions (offset 2), LayerNorm with biases, multi-head attention with biased
projections, ReLU FFN; pre-norm layers, or post-norm ones (OPT-350m's do_layer_norm_before=False), and the
projections in and out of a narrower word embedding (word_embed_proj_dim)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from flashllm_ext.decoder.config import DecoderConfig
from flashllm_ext.decoder.kv_cache import StaticKVCache
from flashllm_ext.decoder.layers import ResidentWeights, attend, cat_rows, embedding_rows, linear, move_tensors

FFN = Callable[[torch.Tensor], torch.Tensor]
POSITION_OFFSET = 2  # OPT's learned position table starts two rows in (its padding convention)


def _norm(weights: ResidentWeights, name: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return weights.get(f"{name}.weight", torch.float32), weights.get(f"{name}.bias", torch.float32)


class OPTLayer:
    def __init__(self, config: DecoderConfig, weights: ResidentWeights, index: int):
        prefix = f"decoder.layers.{index}."
        attn = prefix + "self_attn."
        self.qkv = cat_rows([weights.require(f"{attn}{name}_proj.weight") for name in "qkv"])
        self.qkv_bias = (
            torch.cat([weights.require(f"{attn}{name}_proj.bias") for name in "qkv"]) if config.qkv_bias else None
        )
        self.o = weights.require(f"{attn}out_proj.weight")
        self.o_bias = weights.require(f"{attn}out_proj.bias") if config.o_bias else None
        self.attention_norm = _norm(weights, prefix + "self_attn_layer_norm")
        self.ffn_norm = _norm(weights, prefix + "final_layer_norm")
        self.index, self.norm_before, self.eps = index, config.norm_before, config.norm_eps
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.scale = config.head_dim**-0.5

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.qkv, self.qkv_bias, self.o, self.o_bias, *self.attention_norm, *self.ffn_norm]

    def _layer_norm(self, x: torch.Tensor, norm: tuple[torch.Tensor | None, torch.Tensor | None]) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], *norm, self.eps)

    def ffn_input(self, x: torch.Tensor) -> torch.Tensor:
        """What this layer's FFN would see if the attention added nothing (a look-ahead predictor's input)."""
        return self._layer_norm(x, self.ffn_norm) if self.norm_before else x

    def to(self, device: torch.device) -> None:
        move_tensors(self, device)
        self.attention_norm = tuple(t if t is None else t.to(device) for t in self.attention_norm)
        self.ffn_norm = tuple(t if t is None else t.to(device) for t in self.ffn_norm)

    def __call__(self, x: torch.Tensor, ffn: FFN, cache: StaticKVCache, rotary: None, tables: None) -> torch.Tensor:
        """x [T, d] float32 (the tokens after the cache's `length`) -> the layer's output [T, d]."""
        n_tokens, start, width = x.shape[0], cache.length, self.n_heads * self.head_dim
        h = self._layer_norm(x, self.attention_norm) if self.norm_before else x
        qkv = linear(h, self.qkv, self.qkv_bias).view(n_tokens, 3, self.n_heads, self.head_dim)
        keys, values = cache.write(self.index, qkv[:, 1], qkv[:, 2])
        x = x + linear(
            attend(qkv[:, 0], keys, values, start, None, self.scale).view(n_tokens, width), self.o, self.o_bias
        )
        if not self.norm_before:
            x = self._layer_norm(x, self.attention_norm)
        x = x + ffn(self.ffn_input(x))
        return x if self.norm_before else self._layer_norm(x, self.ffn_norm)


class OPTModel:
    """Embeddings, layers, final norm and LM head of an OPT model, from the store's resident tensors."""

    rotary = None

    def __init__(self, config: DecoderConfig, weights: ResidentWeights, max_len: int):
        if max_len > config.max_positions:
            raise ValueError(f"OPT has {config.max_positions} learned positions: max_len {max_len} is past them")
        self.embedding = weights.require("decoder.embed_tokens.weight")
        self.positions = weights.require("decoder.embed_positions.weight")
        self.project_in = weights.get("decoder.project_in.weight")
        self.project_out = weights.get("decoder.project_out.weight")
        self.layers = [OPTLayer(config, weights, i) for i in range(config.n_layers)]
        self.norm = _norm(weights, "decoder.final_layer_norm")
        head = weights.get("lm_head.weight")
        self.head = self.embedding if head is None else head
        self.eps = config.norm_eps

    def tensors(self) -> list[torch.Tensor | None]:
        own = [self.embedding, self.positions, self.project_in, self.project_out, *self.norm, self.head]
        return own + [t for layer in self.layers for t in layer.tensors()]

    def to(self, device: torch.device) -> OPTModel:
        move_tensors(self, device)
        self.norm = tuple(t if t is None else t.to(device) for t in self.norm)
        for layer in self.layers:
            layer.to(device)
        return self

    def embed(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """ids [T] at positions start.. -> float32 [T, d]."""
        x = embedding_rows(self.embedding, ids)
        if self.project_in is not None:
            x = linear(x, self.project_in)
        first = start + POSITION_OFFSET
        return x + self.positions[first : first + ids.shape[0]].float()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, d] -> float32 [T, vocab]."""
        if self.norm[0] is not None:
            x = F.layer_norm(x, x.shape[-1:], *self.norm, self.eps)
        if self.project_out is not None:
            x = linear(x, self.project_out)
        return linear(x, self.head)
