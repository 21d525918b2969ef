"""Output and arguments shared by every benchmark; timing is `flashllm_ext.harness.timing.time_interleaved`."""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import platform
import statistics
import subprocess
import traceback
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path

# Memory-limited child processes (docs/design.md §8) live in flashllm_ext/harness/cgroup.py (make demo runs its modes that way
# too); re-exported for the bench scripts.
from flashllm_ext.harness.cgroup import CGROUP_V1, CGROUP_V2, MemoryCgroup, drop_page_cache, run_limited_child
from flashllm_ext.harness.report import print_table
from flashllm_ext.harness.timing import time_interleaved  # noqa: F401  (re-exported for the bench scripts)

__all__ = [
    "CGROUP_V1",
    "CGROUP_V2",
    "MemoryCgroup",
    "arg_parser",
    "cycling",
    "device_name",
    "drop_page_cache",
    "emit",
    "error_fields",
    "last_level_cache_bytes",
    "median_rows",
    "process_memory",
    "provenance",
    "run_limited_child",
    "stacked_token_bars",
    "stream_probe",
    "time_interleaved",
]


def device_name(device: str = "cpu") -> str:
    """What ran the benchmark: the GPU's name, or the CPU code path, thread count and OpenMP wait policy."""
    import torch

    import flashllm_ext

    if device == "cuda":
        return torch.cuda.get_device_name()
    isa = flashllm_ext._C.cpu_isa() if flashllm_ext.native_available else "reference"
    return (
        f"cpu ({isa}, {torch.get_num_threads()} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')})"
    )


def process_memory() -> dict[str, int]:
    """This process's memory now, in bytes (Linux /proc/self/status): VmRSS, VmHWM (peak RSS), RssAnon, RssFile
    (file pages mapped, e.g. mmapped weights). Empty where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    return {
        key: int(value.split()[0]) * 1024
        for key, _, value in (line.partition(":") for line in lines)
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    }


def cycling(fn: Callable[[int], object], copies: int) -> Callable[[], object]:
    """A candidate for time_interleaved that calls fn(0), fn(1), ..., fn(copies - 1), fn(0), ...: fn(i) reads copy i
    of its operands, so calls back to back read them from DRAM, not from a cache the previous call filled."""
    copy = itertools.cycle(range(copies))
    return lambda: fn(next(copy))


def last_level_cache_bytes(device: str = "cpu") -> int:
    """The largest cache a weight read back to back could stay in: the GPU's L2, or the CPU's L3 as glibc reports it
    (32 MiB where it reports none, as large as the L3 of one Zen 4 CCD)."""
    import torch

    if device == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    try:
        reported = os.sysconf("SC_LEVEL3_CACHE_SIZE")
    except (ValueError, OSError):
        reported = 0
    return reported if reported > 0 else 32 << 20


def stream_probe(device: str = "cpu", smoke: bool = False):
    """The memory-bandwidth probe: (bytes, fn), fn a streaming sum over that many bytes (512 MiB on the CPU, several
    times any L3; 2 GiB on a GPU, 4x the 50-60 MB L2 of an H100/H200). Bytes / its time is the read bandwidth.
    smoke: 4 MiB, a --smoke run's (the bandwidth of a cache, not of memory)."""
    import torch

    probe_bytes = (4 << 20) if smoke else (2048 << 20) if device == "cuda" else (512 << 20)
    g = torch.Generator().manual_seed(0)
    buf = torch.randint(0, 1 << 20, (probe_bytes // 4,), dtype=torch.int32, generator=g).view(torch.float32)
    buf = buf.nan_to_num_(0.0).to(device)  # random bits: keep the sum finite (cheap either way; the bytes count)
    return probe_bytes, lambda: buf.sum()


def arg_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", action="store_true", help="one JSON object per result line")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per measurement (median)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the smallest shapes, one round, seconds: proves the script runs, measures nothing",
    )
    return parser


def error_fields(error: BaseException) -> dict[str, str]:
    """What a row says of the exception that stopped its configuration: `error` (type and message) and `where`, the
    innermost frames of its traceback (a run on a lent GPU cannot be repeated to find the line that raised)."""
    frames = traceback.extract_tb(error.__traceback__)[-4:]
    return {
        "error": f"{type(error).__name__}: {error}",
        "where": " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames)),
    }


@functools.cache
def provenance() -> dict[str, str]:
    """What every JSON row carries so that a figure can be traced to its run: `commit` (the checkout's, "+" when its
    tracked files differ from it), `date` (UTC) and `host` (the CPU model), taken when this module is imported: a run
    of hours must name the code it started with, not a commit made while it ran."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "+"
    host = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            host = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), host)
    except OSError:
        pass
    return {"commit": commit, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "host": host}


provenance()


def emit(rows: Iterable[dict], as_json: bool, columns: list[str] | None = None) -> None:
    """Print result rows as JSON lines (each with provenance() and the `device` that ran it, unless it has those keys:
    a row without one ran on the CPU) or as an aligned table (flashllm_ext.harness.report.print_table)."""
    if as_json:
        for row in rows:
            fields = provenance() if "device" in row else {**provenance(), "device": device_name()}
            print(json.dumps({**row, **{k: v for k, v in fields.items() if k not in row}}), flush=True)
    else:
        print_table(rows, columns)


def median_rows(rows: list[dict], fields: tuple[str, ...], bench: str) -> list[dict]:
    """One `bench` row per configuration (the rows' values of `fields`) that ran without error: the median of every
    number over its rounds, `rounds` their count, `oom_killed` if any round was."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if not row.get("error"):
            groups.setdefault(tuple(row.get(f) for f in fields), []).append(row)
    out = []
    for group in groups.values():
        numbers = {k for r in group for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        median = {
            k: statistics.median(r[k] for r in group if r.get(k) is not None)
            for k in numbers
            if any(r.get(k) is not None for r in group)
        }
        out.append(
            {
                **group[0],
                **median,
                "bench": bench,
                "rounds": len(group),
                "oom_killed": any(r.get("oom_killed") for r in group),
            }
        )
    return out


def stacked_token_bars(
    ax, labels: list[str], rows: list[dict], parts: Iterable[tuple[str, str]], has_breakdown: str, markersize: int = 20
) -> None:
    """One bar per row (a mode's medians) on `ax`: its per-token parts (keys of `parts`, with their legend labels)
    stacked; a row without the key `has_breakdown` (no runtime stats: dense, accelerate) shows its whole token
    in gray instead; a black tick marks each row's measured ms/token."""
    bottom = [0.0] * len(rows)
    for key, label in parts:
        values = [(r.get(key) or 0.0) if r.get(has_breakdown) is not None else 0.0 for r in rows]
        ax.bar(labels, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.bar(
        labels,
        [r["ms_per_token"] if r.get(has_breakdown) is None else 0.0 for r in rows],
        color="tab:gray",
        label="whole token (no breakdown)",
    )
    ax.plot(labels, [r["ms_per_token"] for r in rows], "k_", markersize=markersize, label="measured ms/token (median)")
    ax.set_ylabel("ms per decode token")
    ax.legend(fontsize=8)
