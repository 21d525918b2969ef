"""`flashllm` command line: one subcommand per offline task.

  flashllm convert CHECKPOINT OUT_DIR [--dtype fp16|bf16|fp32] [--endor] [--force]
  flashllm calibrate-disk [--dir DIR] [--size-mib N]

Each subcommand registers itself with `add_parser` functions below; main() only dispatches.
"""
from __future__ import annotations

import argparse
import sys


def _convert(args: argparse.Namespace) -> int:
    from .store import FlashStore, convert

    out = convert(args.checkpoint, args.out_dir, dtype=args.dtype, endor=args.endor, force=args.force)
    print(FlashStore(out))
    return 0


def _calibrate_disk(args: argparse.Namespace) -> int:
    from .reader import calibrate_disk, disk_profile_path

    profile = calibrate_disk(args.dir, size=args.size_mib << 20)
    print(f"latency {profile.latency_s * 1e6:.0f} us, bandwidth {profile.bandwidth_bps / 1e6:.0f} MB/s, "
          f"coalescing gap {profile.max_gap_bytes >> 10} KiB -> {disk_profile_path()}")
    return 0


def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="convert a HF safetensors dir or GGUF file into a flash store")
    p.add_argument("checkpoint", help="Hugging Face model directory (safetensors, sharded or not) or .gguf file")
    p.add_argument("out_dir", help="store directory to create")
    p.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="fp16")
    p.add_argument("--endor", action="store_true", help="Endor-compress the bundles (pruned models)")
    p.add_argument("--force", action="store_true", help="replace out_dir if it exists")
    p.set_defaults(func=_convert)


def _add_calibrate_disk(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate-disk", help="measure latency and bandwidth for the reader's coalescing model")
    p.add_argument("--dir", default=".", help="a directory on the disk that will hold the stores")
    p.add_argument("--size-mib", type=int, default=1024, help="size of the temporary test file")
    p.set_defaults(func=_calibrate_disk)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashllm", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_convert, _add_calibrate_disk):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
