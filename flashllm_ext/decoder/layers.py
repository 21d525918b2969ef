"""The pieces every lean decoder family is built from: linears on the store's half-precision weights, rotary tables,
attention over the static KV cache, the dense FFN, and resident-weight lookup by name.

Activations are float32 throughout (the residual stream, norms, softmax); weights stay in the store's dtype and
are read by flashllm::half_linear (float32 accumulation) on the CPU, so a token reads each weight byte once. A
quantized store's attention, embedding and LM head stay in their blocks (QuantizedWeight): its linears are
flashllm::quantized_linear, its embedding dequantizes the rows it looks up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from flashllm_ext import ops
from flashllm_ext.decoder.config import DecoderConfig
from flashllm_ext.flash.ffn import store_activation
from flashllm_ext.flash.reader import FlashReader
from flashllm_ext.flash.store import BIAS_ROLES, FlashStore
from flashllm_ext.ops.blocks import QuantizedWeight

if TYPE_CHECKING:
    from flashllm_ext.decoder.kv_cache import StaticKVCache

HALF_LINEAR = torch.ops.flashllm.half_linear.default
QUANTIZED_LINEAR = torch.ops.flashllm.quantized_linear.default
DECODE_ATTENTION = torch.ops.flashllm.decode_attention.default


class OffloadedWeight:
    """A decoder-layer weight that an offload runtime puts in place before each forward of its layer
    (flashllm_ext.decoder.offload): the rows of the layer's matrices `names`, in that order. What a family model
    holds where a resident decoder holds the tensor."""

    def __init__(self, layer: int, names: list[str]):
        self.layer, self.names = layer, names

    def __repr__(self) -> str:
        return f"OffloadedWeight(layer={self.layer}, names={self.names})"


class ComputedWeight(Protocol):
    """A weight that multiplies itself (an offloaded Endor matrix: flashllm_ext.decoder.offload.EndorMatmul)."""

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


Weight = torch.Tensor | QuantizedWeight | ComputedWeight | OffloadedWeight | tuple


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] float32, weight [out, in] (any float dtype, blocks, a ComputedWeight, or a tuple of these whose
    rows are stacked: an offloaded layer's matrices that have no fused form), bias [out] | None -> float32 [T, out]."""
    if isinstance(weight, QuantizedWeight):  # the CPU and CUDA kernels (elsewhere the reference) read the blocks
        return QUANTIZED_LINEAR(x, weight.blocks, weight.fmt, None if bias is None else bias.float())
    if isinstance(weight, tuple):
        y = torch.cat([linear(x, part) for part in weight], dim=-1)
        return y if bias is None else y + bias.float()
    if not isinstance(weight, torch.Tensor):
        return weight.matmul(x, bias)
    if x.device.type == "cpu":
        return HALF_LINEAR(x, weight, bias)  # the op itself: the typed wrapper's call costs ~1 us a matrix
    return F.linear(x.to(weight.dtype), weight, bias).float()


def embedding_rows(embedding: Weight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [T] of an embedding [vocab, d] as float32 [T, d] (blocks: only those rows dequantized)."""
    return embedding.rows(ids) if isinstance(embedding, QuantizedWeight) else embedding[ids].float()


def attention_projections(
    config: DecoderConfig, weights: ResidentWeights, prefix: str
) -> tuple[Weight, torch.Tensor | None, Weight, torch.Tensor | None]:
    """(qkv, its bias, o, its bias) of the attention at `prefix` ("layers.{i}.self_attn."): q, k and v one fused
    matrix (one read of the three); the biases where the config has them, else None."""
    qkv = cat_rows([weights.require(f"{prefix}{name}_proj.weight") for name in "qkv"])
    qkv_bias = torch.cat([weights.require(f"{prefix}{name}_proj.bias") for name in "qkv"]) if config.qkv_bias else None
    o_bias = weights.require(f"{prefix}o_proj.bias") if config.o_bias else None
    return qkv, qkv_bias, weights.require(f"{prefix}o_proj.weight"), o_bias


def cat_rows(weights: list[Weight]) -> Weight:
    """The weights' rows one after another (fused q/k/v), blocks or floats as they come; offloaded weights stay
    offloaded (the runtime fuses them when it puts them in place)."""
    if all(isinstance(w, OffloadedWeight) for w in weights) and len({w.layer for w in weights}) == 1:
        return OffloadedWeight(weights[0].layer, [name for w in weights for name in w.names])
    if all(isinstance(w, QuantizedWeight) for w in weights):
        return QuantizedWeight.cat(weights)
    return torch.cat([w.dequantize() if isinstance(w, QuantizedWeight) else w for w in weights])


class Rotary:
    """RoPE in Llama's half-split form (each head's first half paired with its second), cos and a signed sin float32
    [max_positions, 1, head_dim] computed once from the inverse frequencies: rotating x is x * cos + swap(x) * sin
    with swap exchanging the halves, -sin on the first half (-x2 sin, then +x1 sin), four ops."""

    def __init__(self, inverse_frequencies: torch.Tensor, max_positions: int, device: str | torch.device = "cpu"):
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inverse_frequencies)
        self.cos = torch.cat((angles.cos(), angles.cos()), dim=-1)[:, None, :].to(device)
        self.sin = torch.cat((-angles.sin(), angles.sin()), dim=-1)[:, None, :].to(device)
        self.half = inverse_frequencies.numel()

    @property
    def nbytes(self) -> int:
        return self.cos.nbytes + self.sin.nbytes

    def tables(self, start: int, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [T, 1, head_dim] of positions start .. start + T - 1 (once per forward); one token's as
        [head_dim] rows, what flashllm::decoder_attention takes (indexed here once a token, not in every layer)."""
        if n_tokens == 1:
            return self.cos[start, 0], self.sin[start, 0]
        return self.cos[start : start + n_tokens], self.sin[start : start + n_tokens]

    def __call__(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, H, head_dim] rotated by `tables` (Rotary.tables: [T, 1, head_dim], or one token's [head_dim]),
        float32."""
        cos, sin = tables
        swapped = x.unflatten(-1, (2, self.half)).flip(-2).flatten(-2)
        return torch.addcmul(x * cos, swapped, sin)


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    window: int | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of T new queries at positions start .. start + T - 1 over every key so far.

    q [T, Hq, D] float32; keys, values [start + T, 1, Hkv, D] (the KV cache's views); window: a query at p sees keys
    (p - window, p] only; softcap: scores s become softcap * tanh(s / softcap) before the softmax (Gemma 2). Returns
    float32 [T, Hq * D]. One token: flashllm::decode_attention on the cache's own layout; several (a prompt):
    scaled_dot_product_attention under the causal (and window) mask; soft-capped scores: plain torch ops."""
    n_tokens, n_heads, head_dim = q.shape
    if n_tokens == 1 and softcap is None:
        if window is not None:
            keys, values = keys[-window:], values[-window:]
        out, _ = DECODE_ATTENTION(q.to(keys.dtype), keys, values, scale)
        return out.view(1, n_heads * head_dim)
    positions = torch.arange(start, start + n_tokens, device=q.device)[:, None]
    key_positions = torch.arange(keys.shape[0], device=q.device)[None, :]
    mask = key_positions <= positions
    if window is not None:
        mask &= key_positions > positions - window
    if softcap is not None:
        return _softcapped_attention(q, keys[:, 0].float(), values[:, 0].float(), mask, scale, softcap)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys[:, 0].transpose(0, 1)[None].float(),
        values[:, 0].transpose(0, 1)[None].float(),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).reshape(n_tokens, n_heads * head_dim)


def cached_attention(
    qkv: torch.Tensor,
    cache: StaticKVCache,
    index: int,
    heads: tuple[int, int, int],
    rotary: Rotary,
    tables: tuple[torch.Tensor, torch.Tensor],
    window: int | None,
    scale: float,
    head_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """A layer's attention from its fused projection qkv [T, (Hq + 2 Hkv) * D] of the tokens after the cache's
    length: q and k normed per head (head_norms: q's and k's RMS norm weights [D] and eps; Qwen3's, Gemma 3's), both
    rotated (Rotary, `tables` for these tokens), the new keys and values written to layer `index` of the cache,
    then `attend`. heads: (Hq, Hkv, D). Returns float32 [T, Hq * D]."""
    (n_heads, n_kv_heads, head_dim), n_tokens, start = heads, qkv.shape[0], cache.length
    k_end = (n_heads + n_kv_heads) * head_dim
    qk = qkv[:, :k_end].view(n_tokens, n_heads + n_kv_heads, head_dim)
    if head_norms is not None:
        q_norm, k_norm, eps = head_norms
        q = F.rms_norm(qk[:, :n_heads], q_norm.shape, q_norm, eps)
        qk = torch.cat((q, F.rms_norm(qk[:, n_heads:], k_norm.shape, k_norm, eps)), dim=1)
    qk = rotary(qk, tables)  # q and k rotated together
    keys, values = cache.write(index, qk[:, n_heads:], qkv[:, k_end:].view(n_tokens, n_kv_heads, head_dim))
    return attend(qk[:, :n_heads], keys, values, start, window, scale, softcap)


def _softcapped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """q [T, Hq, D], keys and values [S, Hkv, D] float32, mask bool [T, S] -> float32 [T, Hq * D]."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, keys) * scale
    scores = soft_cap(scores, softcap).masked_fill(~mask, float("-inf"))
    out = torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), values)
    return out.reshape(q.shape[0], -1)


class DenseFFN:
    """One FFN layer's whole weights: act(gate x) * (up x) then down (GLU), or act(up x + b) then down (OPT).
    w_in: the GLU's gate rows then its up rows as one matrix (a token reads them in one call), or the up rows;
    w_out [d, n]: the down projection's rows; biases float or None."""

    def __init__(
        self,
        w_in: Weight,
        w_out: Weight,
        b_in: torch.Tensor | None,
        b_out: torch.Tensor | None,
        glu: bool,
        activation: str,
    ):
        self.w_in, self.w_out, self.b_in, self.b_out = w_in, w_out, b_in, b_out
        self.glu, self.activation = glu, ops.ACTIVATIONS[activation].fn

    @classmethod
    def from_bundles(cls, store: FlashStore, layer: int, bundles: torch.Tensor) -> DenseFFN:
        """The FFN of a flash store's layer from its bundles [n, bundle width] (all of them, in the store's order)."""
        d, glu = store.hidden_size, store.glu
        up = bundles[:, :d]
        w_in = torch.cat((bundles[:, d : 2 * d], up)) if glu else up.contiguous()
        biases = [store.layer_bias(layer, role) for role in ("gate_bias", "up_bias", "down_bias")]
        b_in = None
        if biases[1] is not None:
            b_in = (torch.cat(biases[:2]) if glu else biases[1]).to(bundles.dtype)
        b_out = None if biases[2] is None else biases[2].to(bundles.dtype)
        # w_out [d, n]: the down projection's rows
        return cls(w_in, bundles[:, -d:].t().contiguous(), b_in, b_out, glu, store_activation(store))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.w_in, self.w_out, self.b_in, self.b_out) if t is not None)

    def to(self, device: torch.device) -> DenseFFN:
        move_tensors(self, device)
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = linear(x, self.w_in, self.b_in)
        if self.glu:
            gate, up = h.chunk(2, dim=-1)
            h = self.activation(gate) * up
        else:
            h = self.activation(h)
        return linear(h, self.w_out, self.b_out)


def dense_ffns(store: FlashStore, dtype: torch.dtype) -> list[DenseFFN]:
    """Every FFN layer of the store, read whole (one layer's bundles at a time) into DenseFFN layers."""
    ffns = []
    with FlashReader(store) as reader:
        for layer in range(store.n_layers):
            bundles = store.float_rows(reader.read(layer, torch.arange(store.n_neurons)).data).to(dtype)
            ffns.append(DenseFFN.from_bundles(store, layer, bundles))
    return ffns


class ResidentWeights:
    """The store's resident tensors by Hugging Face name (with or without the leading "model."), cast to `dtype`
    (norms: float32), each taken once: `left()` names what no family claimed, a model the decoder misreads."""

    def __init__(self, store: FlashStore, dtype: torch.dtype):
        self.store, self.dtype = store, dtype
        # The FFN biases are resident tensors too, but the FFN modules read them (FlashStore.layer_bias).
        ffn_biases = {roles[role] for roles in store.ffn_roles for role in BIAS_ROLES if role in roles}
        self.names = {
            name.removeprefix("model."): name
            for name in store.resident_names()
            if not name.startswith("predictor.") and name not in ffn_biases
        }

    def get(self, name: str, dtype: torch.dtype | None = None) -> Weight | None:
        """The tensor (in `dtype`, default the decoder's), or a weight the store holds as blocks as a
        QuantizedWeight."""
        full = self.names.pop(name.removeprefix("model."), None)
        if full is None:
            return None
        weight = self.store.resident_weight(full)
        if isinstance(weight, QuantizedWeight):
            return weight
        return weight.to(dtype or self.dtype, copy=True)

    def require(self, name: str, dtype: torch.dtype | None = None) -> Weight:
        t = self.get(name, dtype)
        if t is None:
            raise ValueError(f"{self.store.path}: the store has no resident tensor {name!r}")
        return t

    def left(self) -> list[str]:
        return sorted(self.names.values())


def move_tensors(obj: object, device: torch.device) -> None:
    """Every tensor attribute of obj moved to device (tied tensors stay tied: each storage moves once)."""
    moved: dict[int, torch.Tensor] = {}
    for name, value in vars(obj).items():
        if isinstance(value, (torch.Tensor, QuantizedWeight)):
            setattr(obj, name, moved.setdefault(id(value), value.to(device)))


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """x squashed into (-cap, cap) as cap * tanh(x / cap) (Gemma 2's logits); x itself when cap is None."""
    return x if cap is None else torch.tanh(x / cap) * cap
