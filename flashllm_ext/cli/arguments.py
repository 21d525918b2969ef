"""Argument types of the `flashllm` subcommands: each refuses a bad value with a one-line usage error."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def ranks(text: str) -> int | list[int]:
    ranks = [int(r) for r in text.split(",")]
    if any(r <= 0 for r in ranks):
        raise argparse.ArgumentTypeError(f"ranks must be positive, got {text!r}")
    return ranks[0] if len(ranks) == 1 else ranks


def group_size(text: str) -> int | str | None:
    if text in ("row", "auto"):
        return None if text == "row" else text
    if not text.isdigit() or int(text) <= 0 or int(text) % 64:
        raise argparse.ArgumentTypeError(f"group size must be 'row', 'auto' or a positive multiple of 64, got {text!r}")
    return int(text)
