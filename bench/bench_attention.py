"""INF² attention kernels: can one worker's native attention keep up with the storage that feeds it?

For each KV block shape (S tokens x B*Hkv (sequence, kv head) pairs x head_dim, fp16, the token-major layout of
the KV store), in one process, interleaved round-robin (flashllm_ext.harness.timing.time_interleaved, medians):
  kernel     ops.decode_attention over the block in memory: K+V bytes consumed per second
  disk       FlashReader (O_DIRECT, page cache bypassed) reading a file of the same size, in 1 MiB sequential reads
             by --io-threads threads, as a worker reads its KV block: bytes read per second
  reference  the pure-torch reference kernel (flashllm_ext.ops.decode_attention_reference) on the same block
ratio = kernel GB/s / disk GB/s (the target: >= 0.8; attention must never be a worker's bottleneck), and the
speedup of the native kernel over the reference. A last row times merge_attention_states against its reference.
Kernels run with --threads OpenMP threads (one worker's share of the cores).

    flock /tmp/flashllm-disk.lock python -m bench.bench_attention [--json] [--rounds 7] [--threads 1] [--max-kv-mb M]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from bench.common import arg_parser, device_name, drop_page_cache, emit, time_interleaved
from flashllm_ext import native_available, ops
from flashllm_ext.ops import decode_attention_reference, merge_attention_states_reference
from flashllm_ext.flash.calibrate import make_test_file
from flashllm_ext.io.paths import resolve_cache_dir
from flashllm_ext.flash.reader import FlashReader

# (name, tokens S, sequences B, query heads Hq, kv heads Hkv, head_dim D): OPT-30B-like heads (56 x 128, MHA) for
# batch 32 on one worker and one of 16 shards; a GQA model (32 query / 8 kv heads, 128) and MHA with head_dim 64;
# the default model (SmolLM2-135M: 9 query / 3 kv heads, 64).
SHAPES = [
    ("opt30b-b32", 64, 32, 56, 56, 128),
    ("opt30b-b32", 256, 32, 56, 56, 128),
    ("opt30b-b32/16", 1024, 2, 56, 56, 128),
    ("gqa32/8-b32", 1024, 32, 32, 8, 128),
    ("mha32-d64-b32", 256, 32, 32, 32, 64),
    ("smollm2-b32", 1024, 32, 9, 3, 64),
]
SMOKE_SHAPES = [("smoke", 16, 2, 4, 2, 32)]
READ_BYTES = 1 << 20
COLUMNS = [
    "shape",
    "tokens",
    "pairs",
    "head_dim",
    "kv_mb",
    "kernel_gbps",
    "disk_gbps",
    "ratio",
    "reference_gbps",
    "speedup_vs_reference",
    "disk_reads",
    "mean_read_kib",
]


def disk_reader(path: Path, nbytes: int, threads: int):
    """A callable reading the first nbytes of `path` (O_DIRECT, 1 MiB rows, no coalescing) and the reader."""
    reader = FlashReader.for_file(path, threads=threads, min_read=0, max_gap=-1)
    n_rows = nbytes // READ_BYTES
    ids = torch.arange(n_rows)
    out = torch.empty(n_rows * READ_BYTES, dtype=torch.uint8)
    last = {}

    def read():
        last["stats"] = reader.read_rows(0, READ_BYTES, n_rows, ids, out)

    return read, reader, last


def main() -> None:
    parser = arg_parser(__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads of the kernels (one worker's cores)")
    parser.add_argument("--io-threads", type=int, default=8, help="FlashReader threads")
    parser.add_argument(
        "--max-kv-mb",
        type=float,
        default=None,
        help="skip block shapes whose K+V exceed this many MB (a quicker, lighter run)",
    )
    parser.add_argument(
        "--dir", type=Path, default=resolve_cache_dir() / "inf2-ops", help="where the disk test file lives"
    )
    args = parser.parse_args()
    if not native_available:
        sys.exit("bench_attention: the native library is not built (make build)")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    if args.smoke:
        args.rounds = 1
    shapes = [
        shape
        for shape in (SMOKE_SHAPES if args.smoke else SHAPES)
        if args.max_kv_mb is None or 4 * shape[1] * shape[2] * shape[4] * shape[5] <= args.max_kv_mb * 1e6
    ]
    max_bytes = max(4 * s * b * hkv * d for _, s, b, _, hkv, d in shapes)  # K and V, 2 bytes each
    file_bytes = -(-max_bytes // READ_BYTES) * READ_BYTES
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / "kv_block.bin"
    if not path.is_file() or path.stat().st_size < file_bytes:
        make_test_file(path, file_bytes)
    drop_page_cache()
    rows = []
    for name, seq, batch, n_q, n_kv, head_dim in shapes:
        q = torch.randn(batch, n_q, head_dim, generator=g).half()
        k = torch.randn(seq, batch, n_kv, head_dim, generator=g).half()
        v = torch.randn(seq, batch, n_kv, head_dim, generator=g).half()
        kv_bytes = k.nbytes + v.nbytes
        read, reader, last = disk_reader(path, -(-kv_bytes // READ_BYTES) * READ_BYTES, args.io_threads)
        with reader:
            times = time_interleaved(
                {
                    "kernel": lambda: ops.decode_attention(q, k, v),
                    "disk": read,
                    "reference": lambda: decode_attention_reference(q, k, v),
                },
                rounds=args.rounds,
                min_seconds=0.05,
            )
        stats = last["stats"]
        kernel_gbps = kv_bytes / times["kernel"] / 1e9
        disk_gbps = stats.bytes_read / times["disk"] / 1e9
        rows.append(
            {
                "bench": "attention",
                "shape": name,
                "tokens": seq,
                "pairs": batch * n_kv,
                "q_heads": n_q,
                "kv_heads": n_kv,
                "head_dim": head_dim,
                "dtype": "float16",
                "kv_mb": round(kv_bytes / 1e6, 1),
                "kernel_ms": round(times["kernel"] * 1e3, 3),
                "kernel_gbps": round(kernel_gbps, 2),
                "disk_ms": round(times["disk"] * 1e3, 3),
                "disk_gbps": round(disk_gbps, 2),
                "ratio": round(kernel_gbps / disk_gbps, 2),
                "reference_gbps": round(kv_bytes / times["reference"] / 1e9, 2),
                "speedup_vs_reference": round(times["reference"] / times["kernel"], 2),
                "disk_bytes": stats.bytes_read,
                "disk_reads": stats.n_reads,
                "mean_read_kib": round(stats.mean_read_bytes / 1024, 1),
                "threads": args.threads,
                "io_threads": args.io_threads,
                "device": device_name(),
            }
        )
        emit(rows[-1:], args.json, None if args.json else COLUMNS)
    # The host's merge: 4 parts (e.g. 2 shards, the writeback buffer, the X-cache rows) of OPT-30B-like heads.
    batch, heads, head_dim = (2, 4, 32) if args.smoke else (32, 56, 128)
    outs = torch.randn(4, batch, heads, head_dim, generator=g)
    lses = torch.randn(4, batch, heads, generator=g)
    times = time_interleaved(
        {
            "kernel": lambda: ops.merge_attention_states(outs, lses),
            "reference": lambda: merge_attention_states_reference(outs, lses),
        },
        rounds=args.rounds,
    )
    emit(
        [
            {
                "bench": "attention",
                "shape": f"merge 4 x {batch} x {heads} x {head_dim}",
                "kernel_ms": round(times["kernel"] * 1e3, 3),
                "reference_ms": round(times["reference"] * 1e3, 3),
                "speedup_vs_reference": round(times["reference"] / times["kernel"], 2),
                "threads": args.threads,
                "device": device_name(),
            }
        ],
        args.json,
    )


if __name__ == "__main__":
    main()
