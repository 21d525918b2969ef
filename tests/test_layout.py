"""The README's table op -> files (section "Ops and their files") is true: every file it names exists, every op
registered in the flashllm namespace has a row and a wrapper in flashllm_ext.ops."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from flashllm_ext import ops

ROOT = Path(__file__).resolve().parents[1]


def op_table() -> dict[str, list[str]]:
    """op -> every path named in its row (backticked cells; "-" names none)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Ops and their files", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| op ")]
    return {row.split("|")[1].strip(): re.findall(r"`([^`]+)`", row) for row in rows}


def test_every_file_named_in_the_table_exists():
    table = op_table()
    assert table, "README.md has no op table"
    missing = [f"{op}: {path}" for op, paths in table.items() for path in paths if not (ROOT / path).is_file()]
    assert not missing, "files named in README.md's op table are missing:\n" + "\n".join(missing)


def test_every_op_has_a_row_and_a_wrapper():
    table = op_table()
    # Every overload of every op; reader_has_io_uring is a build query of the reader, not a kernel op.
    registered = {
        name.removeprefix("flashllm::").split(".")[0]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("flashllm::")
    } - {"reader_has_io_uring"}
    assert registered == set(table) == set(ops.__all__)
    for op, paths in table.items():
        assert f"tests/ops/test_{op}.py" in paths, op  # every op's own test file
