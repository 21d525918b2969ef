"""Cooperative X-cache (INF² §4.3, HILOS): part of the batch keeps the layer input X instead of K/V.

A fraction alpha of the sequences (the first n_x of the batch) keeps X (the attention input, after the norm) in host
memory; every step the host regenerates their K = X Wk, V = X Wv (+ bias, + RoPE where the model has it) for the
whole history and computes their attention itself, while the storage workers handle the other sequences. The two
groups are disjoint sequences, so their results are placed side by side, exactly.

X-cache pays only where X is smaller than K + V and the host's regeneration keeps up with the storage side:
- per token, X holds `hidden` values and K + V hold 2 x kv_heads x head_dim; for MHA X is half of K + V, for GQA
  it can be larger (the default model: 576 against 384): then alpha = 0 (`choose_alpha` says why);
- HILOS balances the link and the devices: alpha = 2 B_link / (B_ssd + B_link), capped by the memory for X;
- the host must regenerate faster than the devices read: per token, K/V cost 2 x hidden x (K+V values) flops to
  regenerate against (K+V bytes) / B_ssd to read. Given the host's measured rate (`host_flops`), regeneration
  slower than the read it replaces gives alpha = 0 (on a CPU host that also runs the storage workers, as on the
  benchmark machine, there is no idle compute to hide it behind), and otherwise alpha is capped where the host's
  regeneration time equals the devices' read time of the other sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashllm_ext.kv.attention import masked_decode_attention
from flashllm_ext.kv.backend import AttentionBackend, pair_starts

# project(layer, x [n, s, hidden], start) -> (k, v) [n, kv_heads, s, head_dim] at positions start..start+s-1;
# start: an int, or int64 [n] (per sequence: a left-padded sequence's tokens start at minus its padding)
Projector = Callable[[int, torch.Tensor, "int | torch.Tensor"], tuple[torch.Tensor, torch.Tensor]]
HOST = -1  # the shard index of the host's X-cache traffic records


@dataclass(frozen=True)
class AlphaChoice:
    alpha: float
    reason: str


def regeneration_flops(hidden: int, kv_heads: int, head_dim: int) -> int:
    """Flops to regenerate one token's K and V from its X (two [hidden] x [hidden, kv_heads x head_dim] GEMVs)."""
    return 2 * hidden * 2 * kv_heads * head_dim


def regime_device_gbps(
    *, host_flops: float, hidden: int, kv_heads: int, head_dim: int, ratio: float, devices: int, itemsize: int = 2
) -> float:
    """The per-device bandwidth (Gb/s) at which reading one token's K/V from `devices` devices together takes
    t_regen / ratio, t_regen being the host's time to regenerate them at `host_flops`: ratio R = t_regen / t_read
    sets an emulated regime (R < 1: regenerating is cheaper than reading, as on INF²'s GPU host)."""
    if ratio <= 0 or devices < 1:
        raise ValueError(f"need ratio > 0 and devices >= 1, got {ratio} and {devices}")
    t_read = regeneration_flops(hidden, kv_heads, head_dim) / host_flops / ratio
    return 2 * kv_heads * head_dim * itemsize * 8 / t_read / 1e9 / devices


def choose_alpha(
    *,
    link_gbps: float,
    storage_gbps: float,
    hidden: int,
    kv_heads: int,
    head_dim: int,
    memory_bytes: int | None = None,
    batch: int = 1,
    context: int = 1,
    n_layers: int = 1,
    itemsize: int = 2,
    host_flops: float | None = None,
) -> AlphaChoice:
    """The fraction of sequences to keep as X. storage_gbps: the devices' aggregate read bandwidth; memory_bytes:
    host memory for X (None: unlimited), which must hold alpha x batch x context x hidden values per layer;
    host_flops: the host's measured K/V regeneration rate in flop/s (None: not limited by compute)."""
    x, kv = hidden, 2 * kv_heads * head_dim
    if x >= kv:
        return AlphaChoice(
            0.0,
            f"X ({x} values per token) is not smaller than K+V ({kv}): regenerating K/V from X "
            f"moves more bytes than reading K/V (GQA); X-cache cannot pay",
        )
    alpha = min(1.0, 2 * link_gbps / (storage_gbps + link_gbps))
    reason = f"HILOS: 2 x {link_gbps:g} / ({storage_gbps:g} + {link_gbps:g}) Gb/s"
    if host_flops is not None:
        t_read = kv * itemsize * 8 / (storage_gbps * 1e9)
        t_regen = regeneration_flops(hidden, kv_heads, head_dim) / host_flops
        if t_regen >= t_read:
            return AlphaChoice(
                0.0,
                f"regenerating a token's K/V takes {t_regen * 1e9:.3g} ns at "
                f"{host_flops / 1e9:.3g} GFLOP/s, reading them {t_read * 1e9:.3g} ns at "
                f"{storage_gbps:g} Gb/s: the compute exceeds the transfer saved; X-cache "
                f"cannot pay",
            )
        balance = t_read / (t_read + t_regen)
        if balance < alpha:
            alpha, reason = (
                balance,
                (
                    f"{reason}, capped where the host's regeneration ({t_regen * 1e9:.3g} ns per "
                    f"token) keeps pace with the devices' reads ({t_read * 1e9:.3g} ns)"
                ),
            )
    if memory_bytes is not None:
        fits = memory_bytes / (batch * context * hidden * itemsize * n_layers)
        if fits < alpha:
            alpha, reason = max(0.0, fits), f"{reason}, capped by {memory_bytes / 2**30:.2f} GiB of host memory for X"
    return AlphaChoice(alpha, reason)


def linear_projector(
    wk: list[torch.Tensor],
    wv: list[torch.Tensor],
    *,
    kv_heads: int,
    bk: list[torch.Tensor] | None = None,
    bv: list[torch.Tensor] | None = None,
    rope: Callable[[torch.Tensor, int | torch.Tensor], torch.Tensor] | None = None,
) -> Projector:
    """K = X Wk^T (+ bk), V = X Wv^T (+ bv) per layer (wk[layer]: [kv_heads x head_dim, hidden]); rope(k, start)
    rotates k [n, kv_heads, s, head_dim] for positions start.. (start: int or int64 [n]; None: no rotary
    embedding, e.g. OPT)."""

    def project(layer: int, x: torch.Tensor, start: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, s, _ = x.shape
        k = torch.nn.functional.linear(x, wk[layer].to(x.dtype), None if bk is None else bk[layer].to(x.dtype))
        v = torch.nn.functional.linear(x, wv[layer].to(x.dtype), None if bv is None else bv[layer].to(x.dtype))
        k = k.view(n, s, kv_heads, -1).transpose(1, 2)
        v = v.view(n, s, kv_heads, -1).transpose(1, 2)
        return (k if rope is None else rope(k, start)), v

    return project


class XCacheAttention(AttentionBackend):
    """The first n_x sequences of the batch via X (host), the rest via `storage` (NearStorageAttention or
    HostKVAttention made for batch - n_x sequences). Same interface as the storage backends; prefill and step
    also take x, the attention input of the new tokens (or take it from set_input). x_dtype: how X is kept
    (default: the storage's KV dtype)."""

    def __init__(
        self,
        storage,
        projector: Projector,
        *,
        n_x: int,
        hidden: int,
        max_tokens: int,
        x_dtype: torch.dtype | None = None,
    ):
        if n_x < 0:
            raise ValueError(f"n_x must be >= 0, got {n_x}")
        self.storage, self.projector, self.n_x, self.hidden = storage, projector, n_x, hidden
        self.batch = n_x + storage.batch
        self.q_heads, self.kv_heads, self.head_dim = storage.q_heads, storage.kv_heads, storage.head_dim
        self.n_layers, self.scale, self.max_tokens = storage.n_layers, storage.scale, max_tokens
        self.group = self.q_heads // self.kv_heads
        self.traffic = storage.traffic
        x_dtype = x_dtype or storage.dtype
        self._x = [torch.empty(n_x, max_tokens, hidden, dtype=x_dtype) for _ in range(self.n_layers)]
        self._len = [0] * self.n_layers
        self._step = [0] * self.n_layers
        self._input: dict[int, torch.Tensor] = {}
        self._starts: torch.Tensor | None = None  # left padding of the X sequences

    def set_starts(self, starts: torch.Tensor | list[int] | None) -> None:
        """Left padding (until reset()): sequence b attends only its tokens from starts[b] on, and its regenerated
        K take positions from there (None: no padding)."""
        per_seq = pair_starts(starts, self.batch, 1)
        self._starts = None if per_seq is None or not bool(per_seq[: self.n_x].any()) else per_seq[: self.n_x]
        self.storage.set_starts(None if per_seq is None else per_seq[self.n_x :])

    def set_input(self, layer: int, x: torch.Tensor) -> None:
        """The attention input of `layer` for the coming prefill/step (x [batch, s, hidden]), for callers (hooks)
        that see X before the K/V it makes."""
        self._input[layer] = x

    def _take_x(self, layer: int, x: torch.Tensor | None) -> torch.Tensor:
        x = self._input.pop(layer, None) if x is None else x
        if x is None:
            raise ValueError(f"layer {layer}: X-cache needs the attention input x (argument or set_input)")
        return x

    def _append_x(self, layer: int, x: torch.Tensor) -> None:
        s = x.shape[1]
        if self._len[layer] + s > self.max_tokens:
            raise ValueError(f"layer {layer}: {self._len[layer]} + {s} tokens exceed max_tokens {self.max_tokens}")
        self._x[layer][:, self._len[layer] : self._len[layer] + s] = x[: self.n_x]
        self._len[layer] += s

    def prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor | None = None) -> None:
        """k, v [batch, kv_heads, s, D]; x [batch, s, hidden]: X rows keep x, the others send k, v to storage."""
        x = self._take_x(layer, x)
        self._append_x(layer, x)
        self.storage.prefill(layer, k[self.n_x :], v[self.n_x :])

    def step(
        self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, x: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [batch, q_heads, D], k_new / v_new [batch, kv_heads, D], x [batch, hidden] (or [batch, 1, hidden]).
        The storage part runs while the host regenerates K/V and computes the X part."""
        x = self._take_x(layer, x).reshape(self.batch, 1, self.hidden)
        step = self._step[layer]
        self._step[layer] += 1
        overlap = hasattr(self.storage, "submit")
        if overlap:
            self.storage.submit(layer, q[self.n_x :], k_new[self.n_x :], v_new[self.n_x :])
        self._append_x(layer, x)
        n = self._len[layer]
        xs = self._x[layer][:, :n]
        start = 0 if self._starts is None else -self._starts
        k, v = self.projector(layer, xs.to(q.dtype), start)  # [n_x, kv_heads, n, D]
        qx = q[: self.n_x].to(k.dtype)
        out_x, lse_x = masked_decode_attention(
            qx, k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3), scale=self.scale, starts=self._starts
        )
        self.traffic.at(layer, step, HOST).x_bytes += xs.nbytes
        if overlap:
            out_s, lse_s = self.storage.collect(layer)
        else:
            out_s, lse_s = self.storage.step(layer, q[self.n_x :], k_new[self.n_x :], v_new[self.n_x :])
        return torch.cat([out_x, out_s]), torch.cat([lse_x, lse_s])

    def flush(self) -> None:
        self.storage.flush()

    def reset(self) -> None:
        self.storage.reset()
        self._len = [0] * self.n_layers
        self._step = [0] * self.n_layers
        self._input.clear()
        self._starts = None

    def close(self) -> None:
        self.storage.close()

    def terminate(self) -> None:
        self.storage.terminate()
