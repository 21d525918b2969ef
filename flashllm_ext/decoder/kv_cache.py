"""The lean decoder's key/value cache: preallocated once for the longest sequence, written in place, never grown.

Layout per layer: k and v [max_len, 1, Hkv, D], token-major with a batch of one, the layout flashllm::decode_attention
reads (INF²'s on-disk KV blocks), so a decode step attends over `k[:length]` with no copy.
"""

from __future__ import annotations

import torch


class StaticKVCache:
    """Keys and values of `n_layers` layers for up to `max_len` tokens of one sequence, in `dtype` on `device`.

    k[i], v[i]: [max_len, 1, n_kv_heads, head_dim]; `length` tokens are filled (every layer alike, advanced by the
    decoder after a forward)."""

    def __init__(
        self,
        n_layers: int,
        max_len: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float16,
        device: str | torch.device = "cpu",
    ):
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        shape = (n_layers, max_len, 1, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len, self.length = max_len, 0
        self.layers = [(self.k[i], self.v[i]) for i in range(n_layers)]  # per-layer views, made once

    @staticmethod
    def bytes_for(n_layers: int, max_len: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """What a cache of these dimensions holds, before it is made (the engine's budget charges it)."""
        return 2 * n_layers * max_len * n_kv_heads * head_dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def check_room(self, n_tokens: int) -> None:
        if self.length + n_tokens > self.max_len:
            raise ValueError(
                f"the KV cache holds {self.max_len} tokens and {self.length} are used: no room for {n_tokens} more "
                "(load the decoder with a larger max_len, or reset it)"
            )

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [T, n_kv_heads, head_dim] of the tokens after the first `length`; returns this layer's
        keys and values so far, [length + T, 1, n_kv_heads, head_dim] views."""
        end = self.length + k.shape[0]
        self.k[layer, self.length : end, 0] = k
        self.v[layer, self.length : end, 0] = v
        return self.k[layer, :end], self.v[layer, :end]

    def reset(self) -> None:
        self.length = 0
