"""Inputs and float64 oracles for the attention ops (decode_attention, merge_attention_states), shared by the CPU
kernel tests and the SIMT-emulated CUDA tests."""
from __future__ import annotations

import math

import torch

__all__ = ["DTYPES", "TOLERANCE", "attention_case", "attention_float64", "merge_float64"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Inputs are rounded to the dtype before the float64 oracle sees them, so the only error left is float32
# accumulation (and the online softmax's different order): the same bound for every dtype.
TOLERANCE = {"atol": 2e-5, "rtol": 2e-5}


def attention_case(batch: int, n_q_heads: int, n_kv_heads: int, head_dim: int, seq: int, dtype: torch.dtype,
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [B, Hq, D], k [S, B, Hkv, D], v [S, B, Hkv, D]) of dtype, standard normal: scores spread over a few
    units, so the softmax is neither flat nor one-hot."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_q_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(seq, batch, n_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(seq, batch, n_kv_heads, head_dim, generator=g).to(dtype)
    return q, k, v


def attention_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention computed directly in float64, query head by query head: (out [B, Hq, D], lse [B, Hq])."""
    batch, n_q_heads, head_dim = q.shape
    group = n_q_heads // k.shape[2]
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(batch, n_q_heads, head_dim, dtype=torch.float64)
    lse = torch.full((batch, n_q_heads), -math.inf, dtype=torch.float64)
    for b in range(batch):
        for h in range(n_q_heads):
            keys, values = k[:, b, h // group].double(), v[:, b, h // group].double()
            if keys.shape[0]:
                scores = keys @ q[b, h].double() * scale
                lse[b, h] = torch.logsumexp(scores, 0)
                out[b, h] = torch.softmax(scores, 0) @ values
    return out, lse


def merge_float64(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-sum-exp merge in float64 over the parts with finite lse: (out [B, H, D], lse [B, H])."""
    outs, lses = outs.double(), lses.double()
    lse = torch.logsumexp(lses, 0)
    weights = torch.where(torch.isfinite(lses), torch.exp(lses - lse.nan_to_num(neginf=0)), 0)
    out = (weights[..., None] * torch.where(torch.isfinite(lses)[..., None], outs, 0)).sum(0)
    return out, lse
