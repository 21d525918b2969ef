"""Timing and output shared by every benchmark.

These machines are shared and noisy (CPU steal up to 70%, disk swings of 2-10x), so a figure is only trusted as
a ratio against a baseline measured in the same process: `time_interleaved` runs the candidates round-robin
(rotating the order every round so none always runs first), and reports medians over the rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout


def time_interleaved(candidates: Mapping[str, Callable[[], object]], rounds: int = 7, warmup: int = 1,
                     min_seconds: float = 0.02, sync: Callable[[], None] = lambda: None) -> dict[str, float]:
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
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, n = candidates[name], calls[name]
            sync()
            start = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            samples[name].append((time.perf_counter() - start) / n)
    return {name: statistics.median(s) for name, s in samples.items()}


def arg_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", action="store_true", help="one JSON object per result line")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per measurement (median)")
    return parser


def emit(rows: Iterable[dict], as_json: bool, columns: list[str] | None = None) -> None:
    """Print result rows as JSON lines or as an aligned table (floats to 3 significant digits)."""
    rows = list(rows)
    if as_json:
        for row in rows:
            print(json.dumps(row), flush=True)
        return
    if not rows:
        return
    columns = columns or list(rows[0])
    cells = [[_fmt(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)), flush=True)


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)
