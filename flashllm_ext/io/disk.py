"""The disk under a store: its latency and bandwidth (a DiskProfile, measured by `calibrate_disk` and saved in the
cache directory), from which FlashReader sizes the gap it reads through to merge two reads (see flashllm_ext.flash.reader).

`flashllm calibrate-disk` runs calibrate_disk, so it is library code; `make_test_file` and `random_read_throughput`
are its measuring tools, shared with bench/bench_io.py.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING


from flashllm_ext.io.paths import resolve_cache_dir


if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class DiskProfile:
    latency_s: float  # time to first byte of a small random direct read, one at a time
    bandwidth_bps: float  # random 1 MiB direct reads with 32 threads
    path: str  # the file the profile was measured on

    def max_gap_bytes(self, threads: int = 1) -> int:
        """Largest gap worth reading through rather than issuing a separate read, with `threads` reads in flight."""
        return int(self.latency_s * self.bandwidth_bps / max(1, threads)) // 4096 * 4096


def disk_profile_path() -> Path:
    return Path(os.environ.get("FLASHLLM_DISK_PROFILE") or resolve_cache_dir() / "disk.json")


def load_disk_profile() -> DiskProfile | None:
    """The saved profile; None when there is none, or with a warning when it is damaged (not JSON, fields missing,
    or a latency or bandwidth no disk has: NaN, infinite, not positive): it only loses the tuning, and every reader
    would otherwise fail on the gap it derives."""
    path = disk_profile_path()
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        profile = DiskProfile(float(raw["latency_s"]), float(raw["bandwidth_bps"]), str(raw["path"]))
        gap = profile.latency_s * profile.bandwidth_bps
        # The gap reaches the native reader as an int64.
        if not (profile.latency_s > 0 and profile.bandwidth_bps > 0 and math.isfinite(gap) and gap < 2**62):
            raise ValueError(f"latency {profile.latency_s} s, bandwidth {profile.bandwidth_bps} B/s")
    except (OSError, KeyError, TypeError, ValueError) as e:  # json's and UnicodeDecodeError are ValueErrors
        warnings.warn(
            f"{path}: ignoring a damaged disk profile ({e!r}); readers use the default coalescing gap "
            "until `flashllm calibrate-disk` measures the disk again",
            stacklevel=2,
        )
        return None
    return profile
