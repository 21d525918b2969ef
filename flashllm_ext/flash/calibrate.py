"""Disk calibration: random-read throughput of the FlashReader by read size and threads, saved as the
DiskProfile the reader sizes its reads by (flashllm calibrate-disk)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch

from flashllm_ext.io.paths import create_file, scratch_file, write_atomic
from flashllm_ext.flash.reader import FlashReader, ReadStats
from flashllm_ext.io.disk import DiskProfile, disk_profile_path


def make_test_file(path: str | os.PathLike, size: int, chunk: int = 64 << 20) -> None:
    """A private file of `size` bytes of non-repeating data, written for real (not sparse: holes read without I/O),
    never through a symbolic link at `path`."""
    generator = torch.Generator().manual_seed(0)
    with os.fdopen(create_file(path, private=True, exclusive=False), "wb") as f:
        block = torch.randint(0, 256, (chunk,), dtype=torch.uint8, generator=generator).numpy()
        written = 0
        while written < size:
            n = min(chunk, size - written)
            block[:8] = list(written.to_bytes(8, "little"))  # distinct chunks, so nothing can dedupe them
            f.write(block[:n].tobytes())
            written += n
        f.flush()
        os.fsync(f.fileno())


def random_read_throughput(
    reader: FlashReader,
    file_size: int,
    read_bytes: int,
    n_reads: int,
    generator: torch.Generator | None = None,
    out: torch.Tensor | None = None,
) -> ReadStats:
    """One batch of n_reads distinct random aligned reads of read_bytes each over the whole file, as fio's
    randread does; a reader with min_read=0 and max_gap=-1 (no coalescing) issues exactly n_reads reads. The bench
    and calibrate_disk use it. out: an optional uint8 buffer of at least n_reads * read_bytes bytes."""
    n_slots = file_size // read_bytes
    ids = torch.randperm(n_slots, generator=generator)[:n_reads]
    nbytes = ids.numel() * read_bytes
    out = torch.empty(nbytes, dtype=torch.uint8) if out is None else out.view(torch.uint8).reshape(-1)[:nbytes]
    return reader.read_rows(0, read_bytes, n_slots, ids, out)


def calibrate_disk(directory: str | os.PathLike = ".", size: int = 1 << 30, save: bool = True) -> DiskProfile:
    """Measure latency to first byte (4 KiB direct reads, one thread) and bandwidth (1 MiB direct reads,
    32 threads) on a temporary test file of `size` bytes in `directory` (paths.scratch_file); save the profile for
    FlashReader."""
    if size < 1 << 20:
        raise ValueError(f"size must be at least 1 MiB (the bandwidth is measured with 1 MiB reads), got {size} bytes")
    if not Path(directory).is_dir():
        raise NotADirectoryError(f"{directory} is not a directory")
    with scratch_file(directory, "calibrate.bin") as path:
        make_test_file(path, size)
        generator = torch.Generator().manual_seed(1)
        from flashllm_ext.flash.reader import FlashReader  # reader.py imports this module

        with FlashReader.for_file(path, threads=1, min_read=0, max_gap=-1) as one:
            latency = random_read_throughput(one, size, 4096, min(2000, size // 4096), generator)
        with FlashReader.for_file(path, threads=32, min_read=0, max_gap=-1) as many:
            bandwidth = random_read_throughput(many, size, 1 << 20, min(512, size >> 20), generator)
    profile = DiskProfile(
        latency.wall_s / latency.n_reads, bandwidth.bytes_read / bandwidth.wall_s, str(Path(directory).resolve())
    )
    if save:
        target = disk_profile_path()
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(
            target,
            json.dumps(
                {
                    **asdict(profile),
                    "max_gap_bytes_1_thread": profile.max_gap_bytes(1),
                    "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                },
                indent=1,
            ).encode(),
            private=False,
        )
    return profile
