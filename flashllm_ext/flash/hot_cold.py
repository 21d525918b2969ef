"""The hot-cold split of a layer's cache rows: how many of its most frequently active neurons to pin (the hot set,
read once, never evicted) and how many rows to leave the others (the cold window cache), by a cost model of one
token's read time.

For `rows` cache rows and neuron frequencies f (the fraction of calibration tokens whose set holds each neuron,
NeuronPredictor.frequency), pinning the H most frequent leaves C = rows - H rows and a cold set of expected size
E = sum of the other f (spread sqrt(sum f (1 - f)), activations taken as independent). When C holds E + 3 spreads,
a cold neuron is read unless it was active in one of the last w = min(window, C / E) tokens: expected misses
sum f (1 - f)^w. Otherwise the cold set is read whole, in ceil((E + 3 spreads) / C) parts (cache steps, each a batch of
reads). A token's read time is then misses x row bytes / bandwidth + parts x latency, with the disk's calibrated
profile (flashllm calibrate-disk) or, without one, DEFAULT_PROFILE. The split with the least time wins; H = 0 is the
per-layer window cache.
"""

from __future__ import annotations

import math

import torch

from flashllm_ext.io.disk import load_disk_profile

DEFAULT_PROFILE = (100e-6, 2e9)  # (latency of a batch of reads in seconds, bytes per second): an NVMe SSD's order
GRID = 256  # hot counts tried per layer: every rows / GRID


def hot_count(frequency: torch.Tensor, rows: int, row_bytes: int, window: int) -> int:
    """The number of hot (pinned) rows, in [0, rows - 1], of a layer with `rows` cache rows for neurons whose
    frequencies are `frequency` [n] (any order), bundles of `row_bytes`, a cache window of `window` tokens."""
    if rows < 1:
        raise ValueError(f"a cache needs at least one row, got {rows}")
    profile = load_disk_profile()
    latency_s, bandwidth = DEFAULT_PROFILE if profile is None else (profile.latency_s, profile.bandwidth_bps)
    f = frequency.double().clamp(0.0, 1.0).sort(descending=True).values
    # tail sums: E[H] and var[H] of the cold set when the first H neurons are hot
    cold = torch.cat([f.flip(0).cumsum(0).flip(0), f.new_zeros(1)])
    spread = torch.cat([(f * (1 - f)).flip(0).cumsum(0).flip(0), f.new_zeros(1)]).sqrt()
    best, best_time = 0, math.inf
    for hot in range(0, min(rows, f.numel() + 1), max(1, rows // GRID)):
        free = rows - hot
        expected, size = float(cold[hot]), float(cold[hot] + 3 * spread[hot])
        if free >= size:
            tokens = min(window, max(1, int(free / max(expected, 1e-9))))
            tail = f[hot:]
            misses, parts = float((tail * (1 - tail) ** tokens).sum()), 1
        else:
            misses, parts = expected, math.ceil(size / free)
        seconds = misses * row_bytes / bandwidth + parts * latency_s
        if seconds < best_time:
            best, best_time = hot, seconds
    return best


def hot_ids(frequency: torch.Tensor, count: int) -> torch.Tensor:
    """int64 [count]: the `count` most frequent neurons, ties by lower id (a stable order)."""
    return frequency.float().sort(descending=True, stable=True).indices[:count].sort().values
