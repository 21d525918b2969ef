"""The hot-cold split of a layer's cache rows: how many of its most frequently active neurons to pin (the hot set,
read once, never evicted) and how many rows to leave the others (the cold window cache), by a cost model of one
token's read time.

For `rows` cache rows and neuron frequencies f (the fraction of calibration tokens whose set holds each neuron,
NeuronPredictor.frequency), pinning the H most frequent leaves C = rows - H rows and a cold set of expected size
E = sum of the other f (spread sqrt(sum f (1 - f)), activations taken as independent). When C holds E + 3 spreads,
a cold neuron is read unless it was active in one of the last w = min(window, C / E) tokens; otherwise the cold set
is read whole, in ceil((E + 3 spreads) / C) parts (cache steps, each a batch of reads in flight together).

The reads are counted, not estimated: SAMPLES tokens' cold misses are drawn from f (one set of random numbers for
every candidate H, so candidates differ only by H) and handed to `plan`, the reader's coalescing plan for the layer
(FlashReader.plan_layer: rows close together on the store are one read, gaps included), so the store's order (a
frequency or co-activation placement puts a cold set's rows together) and the bytes read through gaps count. A
token's read time is parts x latency + reads x latency / threads (a read's latency overlaps the others' in flight)
+ bytes / bandwidth, with the disk's calibrated profile (flashllm calibrate-disk) or, without one, DEFAULT_PROFILE.
The split with the least time wins; H = 0 is the per-layer window cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from flashllm_ext.io.disk import load_disk_profile

DEFAULT_PROFILE = (100e-6, 2e9)  # (latency of a batch of reads in seconds, bytes per second): an NVMe SSD's order
GRID = 64  # hot counts tried per layer: every rows / GRID
SAMPLES = 4  # tokens whose cold misses are planned per candidate

# ids int64 [k] (sorted rows of the layer) -> int64 [reads, 2] (file offset, length): the reader's coalescing plan
ReadPlan = Callable[[torch.Tensor], torch.Tensor]


def one_read_per_row(row_bytes: int) -> ReadPlan:
    """The plan of a reader that coalesces nothing: each row its own read of `row_bytes`."""
    return lambda ids: torch.stack([ids * row_bytes, torch.full_like(ids, row_bytes)], dim=1)


def hot_count(
    frequency: torch.Tensor,
    rows: int,
    row_bytes: int,
    window: int,
    plan: ReadPlan | None = None,
    threads: int = 1,
) -> int:
    """The number of hot (pinned) rows, in [0, rows - 1], of a layer with `rows` cache rows for neurons whose
    frequencies are `frequency` [n] (indexed by the store's rows: on a placed store, in its order), bundles of
    `row_bytes`, a cache window of `window` tokens; `plan`: the reader's coalescing plan for the layer's rows
    (None: one read per row), `threads`: the reads it keeps in flight."""
    if rows < 1:
        raise ValueError(f"a cache needs at least one row, got {rows}")
    profile = load_disk_profile()
    latency_s, bandwidth = DEFAULT_PROFILE if profile is None else (profile.latency_s, profile.bandwidth_bps)
    plan = plan or one_read_per_row(row_bytes)
    f = frequency.double().clamp(0.0, 1.0)
    by_frequency = most_frequent_first(frequency)  # the order hot_ids pins in
    sorted_f = f[by_frequency]
    # tail sums: E[H] and var[H] of the cold set when the first H neurons are hot
    cold = torch.cat([sorted_f.flip(0).cumsum(0).flip(0), f.new_zeros(1)])
    spread = torch.cat([(sorted_f * (1 - sorted_f)).flip(0).cumsum(0).flip(0), f.new_zeros(1)]).sqrt()
    # rank of each row among the most frequent: row r is hot when rank[r] < H
    rank = torch.empty_like(by_frequency)
    rank[by_frequency] = torch.arange(f.numel())
    # the tokens drawn: active[s, t] is token t of sample s, t = 0 the token read, 1..window the ones before it
    generator = torch.Generator().manual_seed(0)
    active = torch.rand(SAMPLES, window + 1, f.numel(), generator=generator, dtype=torch.float64) < f
    best, best_time = 0, math.inf
    for hot in range(0, min(rows, f.numel() + 1), max(1, rows // GRID)):
        free = rows - hot
        expected, size = float(cold[hot]), float(cold[hot] + 3 * spread[hot])
        if free >= size:
            tokens, parts = min(window, max(1, int(free / max(expected, 1e-9)))), 1
            missed = active[:, 0] & ~active[:, 1 : tokens + 1].any(dim=1)
        else:
            missed, parts = active[:, 0], math.ceil(size / free)
        missed = missed & (rank >= hot)
        reads = n_bytes = 0
        for sample in missed:
            planned = plan(sample.nonzero().flatten())
            reads, n_bytes = reads + planned.shape[0], n_bytes + int(planned[:, 1].sum())
        seconds = parts * latency_s + (reads * latency_s / max(1, threads) + n_bytes / bandwidth) / SAMPLES
        if seconds < best_time:
            best, best_time = hot, seconds
    return best


def most_frequent_first(frequency: torch.Tensor) -> torch.Tensor:
    """int64 [n]: the neurons by descending frequency, ties by lower id (a stable order)."""
    return frequency.float().sort(descending=True, stable=True).indices


def hot_ids(frequency: torch.Tensor, count: int) -> torch.Tensor:
    """int64 [count]: the `count` most frequent neurons (most_frequent_first), in id order."""
    return most_frequent_first(frequency)[:count].sort().values
