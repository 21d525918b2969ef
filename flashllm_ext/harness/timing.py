"""Timing shared by the benchmarks and the demo.

These machines are shared and noisy (CPU steal up to 70%, disk swings of 2-10x), so a figure is only trusted as
a ratio against a baseline measured in the same process: `time_interleaved` runs the candidates round-robin
(rotating the order every round so none always runs first), and reports medians over the rounds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping


def time_interleaved(
    candidates: Mapping[str, Callable[[], object]],
    rounds: int = 7,
    warmup: int = 1,
    min_seconds: float = 0.02,
    sync: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """Median seconds per call of each candidate, measured round-robin over `rounds` rounds.

    Each sample runs a candidate enough times back to back to last at least `min_seconds` (the count is fixed
    per candidate after warm-up), so timer resolution never dominates. `sync` (e.g. torch.cuda.synchronize)
    runs before the clock is read.
    """
    calls = {}
    for name, fn in candidates.items():
        for _ in range(warmup):
            fn()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        once = max(time.perf_counter() - start, 1e-7)
        calls[name] = max(1, int(min_seconds / once))
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, n = candidates[name], calls[name]
            sync()
            start = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            samples[name].append((time.perf_counter() - start) / n)
    return {name: statistics.median(s) for name, s in samples.items()}
