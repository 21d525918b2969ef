"""Inputs and float64 oracles for the attention ops (decode_attention, merge_attention_states), shared by the CPU
kernel tests and the SIMT-emulated CUDA tests."""

from __future__ import annotations

import math

import torch

__all__ = ["DTYPES", "TOLERANCE", "attention_case", "attention_float64", "merge_case", "merge_float64"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Inputs are rounded to the dtype before the float64 oracle sees them, so the only error left is float32
# accumulation (and the online softmax's different order): the same bound for every dtype.
TOLERANCE = {"atol": 2e-5, "rtol": 2e-5}


def attention_case(
    batch: int, n_q_heads: int, n_kv_heads: int, head_dim: int, seq: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [B, Hq, D], k [S, B, Hkv, D], v [S, B, Hkv, D]) of dtype, standard normal: scores spread over a few
    units, so the softmax is neither flat nor one-hot."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_q_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(seq, batch, n_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(seq, batch, n_kv_heads, head_dim, generator=g).to(dtype)
    return q, k, v


def attention_float64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention computed directly in float64, kv heads repeated for GQA: (out [B, Hq, D], lse [B, Hq])."""
    group = q.shape[1] // k.shape[2]
    scale = 1 / math.sqrt(q.shape[2]) if scale is None else scale
    keys = k.double().repeat_interleave(group, dim=2)  # [S, B, Hq, D]
    values = v.double().repeat_interleave(group, dim=2)
    scores = (keys * q.double()).sum(-1) * scale  # [S, B, Hq]
    lse = torch.logsumexp(scores, 0)  # -inf when S = 0
    out = (torch.softmax(scores, 0)[..., None] * values).sum(0) if k.shape[0] else torch.zeros(q.shape).double()
    return out, lse


def merge_case(
    parts: int, batch: int, heads: int, head_dim: int, seed: int = 0, empty: float = 0.3
) -> tuple[torch.Tensor, torch.Tensor]:
    """(outs [P, B, H, D], lses [P, B, H]): lses spread over +-30 so the weights span many magnitudes; a fraction
    `empty` of the parts is empty (lse -inf, out NaN: an empty part's buffer must not be read)."""
    g = torch.Generator().manual_seed(seed)
    outs = torch.randn(parts, batch, heads, head_dim, generator=g)
    lses = (torch.rand(parts, batch, heads, generator=g) - 0.5) * 60
    hole = torch.rand(parts, batch, heads, generator=g) < empty
    lses[hole] = -math.inf
    outs[hole] = math.nan
    return outs, lses


def merge_float64(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-sum-exp merge in float64 over the parts with finite lse: (out [B, H, D], lse [B, H])."""
    outs, lses = outs.double(), lses.double()
    lse = torch.logsumexp(lses, 0)
    weights = torch.where(torch.isfinite(lses), torch.exp(lses - lse.nan_to_num(neginf=0)), 0)
    out = (weights[..., None] * torch.where(torch.isfinite(lses)[..., None], outs, 0)).sum(0)
    return out, lse
