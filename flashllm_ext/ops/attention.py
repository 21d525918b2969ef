"""decode_attention and merge_attention_states: INF²'s attention over a shard of the KV cache.

Each op: schema, checks (worded as the native kernels word them, csrc/common/<op>_checks.h), pure-torch
reference kernel (registered as CompositeExplicitAutograd: every device without a native kernel, the test
oracle and the benchmark baseline), fake kernel, and the typed wrapper library code calls.
"""

from __future__ import annotations

import math

import torch

from flashllm_ext.ops.library import LIB


# ------------------------------------------------------------------------------------------------ decode_attention
# One decode step of attention for a block of sequences: each sequence has one new query token and S keys/values
# in the token-major layout of INF²'s on-disk KV blocks, k and v [S, B, Hkv, D] ([token][batch x head][head_dim]).
# Query head h reads kv head h // (Hq // Hkv) (MHA, GQA and MQA alike). Returns the softmax(scale q.k)-weighted sum
# of v and the natural log of the softmax's denominator, both float32: the partial state merge_attention_states
# combines exactly, so attention over disjoint key sets (disk blocks, the writeback buffer, X-cache rows) can run
# anywhere and be merged. No masking: every sequence of a block has the same S. S = 0: out 0, lse -inf.
LIB.define("decode_attention(Tensor q, Tensor k, Tensor v, float? scale=None) -> (Tensor, Tensor)")

ATTENTION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_decode_attention_metadata(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> float:
    """The metadata checks of csrc/common/decode_attention_checks.h. Returns the scale to use."""
    torch._check(
        q.dtype in ATTENTION_DTYPES and q.dim() == 3,
        lambda: (
            f"decode_attention: q must be a 3-D float32/float16/bfloat16 tensor [B, Hq, D], got "
            f"{q.dtype} of shape {list(q.shape)}"
        ),
    )
    batch, n_q_heads, head_dim = q.shape
    for name, t in (("k", k), ("v", v)):
        torch._check(
            t.dtype == q.dtype and t.dim() == 4,
            lambda: (
                f"decode_attention: {name} must be a 4-D tensor [S, B, Hkv, D] of q's dtype, got "
                f"{t.dtype} of shape {list(t.shape)}"
            ),
        )
        torch._check(t.device == q.device, lambda: f"decode_attention: {name} is on {t.device} but q is on {q.device}")
    torch._check(
        k.shape == v.shape,
        lambda: f"decode_attention: k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}",
    )
    torch._check(
        k.shape[1] == batch and k.shape[3] == head_dim,
        lambda: (
            f"decode_attention: k and v must be [S, B={batch}, Hkv, D={head_dim}] to match q "
            f"{list(q.shape)}, got {list(k.shape)}"
        ),
    )
    torch._check(head_dim >= 1, lambda: "decode_attention: head_dim D must be >= 1")
    n_kv_heads = k.shape[2]
    torch._check(
        n_kv_heads >= 1 and n_q_heads >= 1 and n_q_heads % n_kv_heads == 0,
        lambda: (
            f"decode_attention: the query heads Hq={n_q_heads} must be a positive multiple of the kv "
            f"heads Hkv={n_kv_heads}"
        ),
    )
    if scale is None:
        return head_dim**-0.5
    torch._check(math.isfinite(scale), lambda: f"decode_attention: scale must be finite, got {scale}")
    return scale


def decode_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch decode attention in float32 (two passes: exact logsumexp, then the weighted sum).
    q [B, Hq, D], k and v [S, B, Hkv, D] -> out [B, Hq, D] float32, lse [B, Hq] float32."""
    scale = _check_decode_attention_metadata(q, k, v, scale)
    batch, n_q_heads, head_dim = q.shape
    n_kv_heads = k.shape[2]
    qf = q.float().reshape(batch, n_kv_heads, n_q_heads // n_kv_heads, head_dim)
    scores = torch.einsum("bhgd,sbhd->bhgs", qf, k.float()) * scale
    lse = torch.logsumexp(scores, dim=-1)  # -inf when S = 0
    weights = torch.exp(scores - lse[..., None])
    out = torch.einsum("bhgs,sbhd->bhgd", weights, v.float())  # zeros when S = 0
    return out.reshape(batch, n_q_heads, head_dim).contiguous(), lse.reshape(batch, n_q_heads).contiguous()


@torch.library.impl(LIB, "decode_attention", "CompositeExplicitAutograd")
def _decode_attention_default(q, k, v, scale=None):
    return decode_attention_reference(q, k, v, scale)


@torch.library.register_fake("flashllm::decode_attention")
def _decode_attention_fake(q, k, v, scale=None):
    _check_decode_attention_metadata(q, k, v, scale)
    return q.new_empty(q.shape, dtype=torch.float32), q.new_empty(q.shape[:2], dtype=torch.float32)


# ------------------------------------------------------------------------------------------------ merge_attention_states
# The exact log-sum-exp merge of P partial attention results over disjoint key sets:
#   lse = log sum_p exp(lse_p),  out = sum_p exp(lse_p - lse) out_p.
# A part whose weight exp(lse_p - lse) is 0 (lse_p = -inf: an empty part) contributes nothing, its out_p not read
# (so an empty part's buffer may hold anything). Every part empty: out 0 and lse -inf, never NaN (FlashInfer and
# vLLM computed exp(-inf - -inf) = NaN there). A NaN lse_p, or a +inf one, makes that (b, h)'s out and lse NaN.
LIB.define("merge_attention_states(Tensor outs, Tensor lses) -> (Tensor, Tensor)")


def _check_merge_attention_states_metadata(outs: torch.Tensor, lses: torch.Tensor) -> None:
    """The metadata checks of csrc/common/merge_attention_states_checks.h."""
    torch._check(
        outs.dtype == torch.float32 and outs.dim() == 4,
        lambda: (
            f"merge_attention_states: outs must be a 4-D float32 tensor [P, B, H, D], got {outs.dtype} "
            f"of shape {list(outs.shape)}"
        ),
    )
    torch._check(
        lses.dtype == torch.float32 and lses.dim() == 3,
        lambda: (
            f"merge_attention_states: lses must be a 3-D float32 tensor [P, B, H], got {lses.dtype} "
            f"of shape {list(lses.shape)}"
        ),
    )
    torch._check(
        lses.shape == outs.shape[:3],
        lambda: (
            f"merge_attention_states: lses must be [P, B, H] = {list(outs.shape[:3])} to match outs "
            f"{list(outs.shape)}, got {list(lses.shape)}"
        ),
    )
    torch._check(
        lses.device == outs.device,
        lambda: f"merge_attention_states: lses is on {lses.device} but outs is on {outs.device}",
    )


def merge_attention_states_reference(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch log-sum-exp merge. outs [P, B, H, D], lses [P, B, H] -> out [B, H, D], lse [B, H] (float32)."""
    _check_merge_attention_states_metadata(outs, lses)
    if lses.shape[0] == 0:
        return outs.new_zeros(outs.shape[1:]), lses.new_full(lses.shape[1:], float("-inf"))
    top = lses.amax(dim=0)  # NaN propagates; +inf makes lses - top NaN below
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)  # every part empty: exp(-inf - 0) = 0
    scaled = torch.exp(lses - top)
    total = scaled.sum(dim=0)
    lse = top + torch.log(total)  # log 0 = -inf when every part is empty
    weights = scaled / torch.where(total == 0, torch.ones_like(total), total)
    terms = torch.where(weights[..., None] == 0, torch.zeros((), device=outs.device), weights[..., None] * outs)
    return terms.sum(dim=0), lse


@torch.library.impl(LIB, "merge_attention_states", "CompositeExplicitAutograd")
def _merge_attention_states_default(outs, lses):
    return merge_attention_states_reference(outs, lses)


@torch.library.register_fake("flashllm::merge_attention_states")
def _merge_attention_states_fake(outs, lses):
    _check_merge_attention_states_metadata(outs, lses)
    return outs.new_empty(outs.shape[1:]), lses.new_empty(lses.shape[1:])


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one new query token per sequence over S keys/values in INF²'s token-major KV block layout.

    q: [B, Hq, D] float32 | float16 | bfloat16
    k, v: [S, B, Hkv, D] of q.dtype ([token][batch x head][head_dim], the on-disk layout); S >= 0; Hq a multiple
      of Hkv: query head h reads kv head h // (Hq // Hkv) (MHA, GQA, MQA). No masking.
    scale: multiplies q.k; None for 1/sqrt(D)
    Any strides are accepted (the native kernels copy an input whose last dimension is not contiguous).
    Returns (out [B, Hq, D] float32, lse [B, Hq] float32): out = softmax(scale q.k) @ v accumulated in float32,
    lse = log sum_j exp(scale q.k_j) (natural log). S = 0 gives out 0 and lse -inf. merge_attention_states
    combines results over disjoint key sets exactly. inf or NaN inputs give NaN in the affected (b, h) (a score of
    exactly -inf gets weight 0). The CUDA kernel takes D <= 256.
    """
    return torch.ops.flashllm.decode_attention.default(q, k, v, scale)


def merge_attention_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact log-sum-exp merge of P partial attention results over disjoint key sets.

    outs: [P, B, H, D] float32; lses: [P, B, H] float32 (decode_attention's outputs, stacked); any strides; P >= 0
    Returns (out [B, H, D], lse [B, H]) float32: lse = log sum_p exp(lse_p), out = sum_p exp(lse_p - lse) out_p.
    A part with lse_p = -inf (no keys) contributes nothing and its out_p is not read; every part empty (or P = 0)
    gives out 0 and lse -inf, never NaN. A NaN or +inf lse_p makes that (b, h)'s out and lse NaN.
    """
    return torch.ops.flashllm.merge_attention_states.default(outs, lses)
