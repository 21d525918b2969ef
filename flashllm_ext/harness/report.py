"""The one table printer, shared by the benchmarks (bench/common.py) and the demo."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


def print_table(rows: Iterable[Mapping[str, object]], columns: Sequence[str] | None = None) -> None:
    """Print rows as an aligned table: a header of column names, then one line per row (floats to 3 significant
    digits, whole numbers from 1000 up). columns: which keys, in order (default: the first row's)."""
    rows = list(rows)
    if not rows:
        return
    columns = list(columns or rows[0])
    cells = [[_format_cell(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)), flush=True)


def _format_cell(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)
