"""Decode attention over a KV cache, checked step by step against dense attention (SDPA over the full K/V)."""

import torch
import torch.nn.functional as F


def dense_attention(q, k, v, scale=None, starts=None):
    """q [B, Hq, D] over k, v [B, Hkv, S, D] (GQA: head h reads kv head h // (Hq // Hkv)); sequence b attends only
    tokens >= starts[b] (left padding; None: all)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
    mask = None if starts is None else (torch.arange(k.shape[2])[None] >= torch.as_tensor(starts)[:, None])
    mask = None if mask is None else mask[:, None, None]
    return F.scaled_dot_product_attention(q.float()[:, :, None], k, v, attn_mask=mask, scale=scale)[:, :, 0]


def random_kv(batch, kv_heads, s, dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, kv_heads, s, dim, generator=g).to(dtype),
        torch.randn(batch, kv_heads, s, dim, generator=g).to(dtype),
    )


def run_decode(attn, *, n_layers, batch, q_heads, kv_heads, dim, dtype, prompt, steps, scale=None, seed=0, starts=None):
    """Prefill + `steps` decode steps through `attn` (left padding `starts`, if given); checks every step against
    dense attention. Returns the full K/V of layer 0."""
    g = torch.Generator().manual_seed(seed + 100)
    if starts is not None:
        attn.set_starts(starts)
    ks, vs = [], []
    for layer in range(n_layers):
        k, v = random_kv(batch, kv_heads, prompt, dim, dtype, seed + layer)
        attn.prefill(layer, k, v)
        ks.append(k)
        vs.append(v)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for _ in range(steps):
        for layer in range(n_layers):
            q = torch.randn(batch, q_heads, dim, generator=g).to(dtype)
            k_new = torch.randn(batch, kv_heads, dim, generator=g).to(dtype)
            v_new = torch.randn(batch, kv_heads, dim, generator=g).to(dtype)
            ks[layer] = torch.cat([ks[layer], k_new[:, :, None]], dim=2)
            vs[layer] = torch.cat([vs[layer], v_new[:, :, None]], dim=2)
            out, lse = attn.step(layer, q, k_new, v_new)
            assert out.shape == (batch, q_heads, dim) and lse.shape == (batch, q_heads)
            torch.testing.assert_close(out, dense_attention(q, ks[layer], vs[layer], scale, starts), atol=tol, rtol=tol)
    return ks[0], vs[0]
