"""`flashllm` command line: one subcommand per offline task.

  flashllm convert CHECKPOINT OUT_DIR [--dtype fp16|bf16|fp32|q8|q4] [--down-format q8_0|q4_0|q4_1] [--endor] [--force]
  flashllm calibrate-disk [--dir DIR] [--size-mib N]
  flashllm train-predictors CHECKPOINT [--store DIR] [--method M] [--density D] [--rank R] ...
  flashllm run STORE_DIR --tokenizer PATH [--prompt TEXT] [--chat] [--mode flash] [--budget 50%] [--tokens N]
               [--temperature T --top-k K --top-p P --repeat-penalty R --seed S] [--stop TEXT] [--hf]
               [--device cpu|cuda]
  flashllm offload STORE_DIR --convert CHECKPOINT [--endor] [--dtype fp16|bf16|fp32|q8|q4]
                   | --tokenizer PATH [--mode dense|endor|endor+more-resident] [--budget 30%]
                   [--device cuda --device-budget 20%] ...

Each subcommand registers itself with an `add_*` function of its module (cli.prepare, cli.generate); main() only
dispatches. A user's mistake ends any of them with one line on stderr and a non-zero status, before the long work
where it can be known then.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from flashllm_ext.cli import generate, prepare

INTERRUPTED = 130  # the shell's status for a command ended by SIGINT


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (argparse prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flashllm", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (
        prepare.add_convert,
        prepare.add_calibrate_disk,
        prepare.add_train_predictors,
        generate.add_run,
        generate.add_offload,
    ):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one subcommand. A user's mistake (OSError: a missing or unreadable file; ValueError, FormatError among
    them: a malformed file or a value out of range) exits with one line on stderr and status 1, Ctrl-C with status
    130; any other exception is a bug and keeps its traceback."""
    command = "flashllm"
    try:
        args = build_parser().parse_args(argv)
        command = f"flashllm {args.command}"
        return args.func(args)
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        raise SystemExit(INTERRUPTED) from None
    except (OSError, ValueError) as e:
        raise SystemExit(f"{command}: {' '.join(str(e).split())}") from None
