"""Where flashllm_ext keeps what it downloads, measures or generates: one cache directory for everything."""
from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from .errors import FormatError


def resolve_cache_dir(path: str | os.PathLike | None = None) -> Path:
    """The cache directory: `path`, else $FLASHLLM_CACHE, else ~/.cache/flashllm_ext (created if missing)."""
    chosen = Path(path or os.environ.get("FLASHLLM_CACHE") or Path.home() / ".cache" / "flashllm_ext")
    chosen.mkdir(parents=True, exist_ok=True)
    return chosen


def regular_file(path: str | os.PathLike, field: str = "file") -> str:
    """`path` as a string once it names a regular file (links followed). Every loader calls it before opening a
    file: open() of a FIFO blocks until a writer appears, and a device or socket streams without end. Raises
    FileNotFoundError (or another OSError) when it cannot be looked up, FormatError naming `field` otherwise."""
    path = os.fspath(path)
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else
                "a socket" if stat.S_ISSOCK(mode) else "a device")
        raise FormatError(field, f"is {kind}, not a regular file", path)
    return path


def check_out_dir(out_dir: str | os.PathLike, force: bool, store_file: str,
                  source: str | os.PathLike | None = None) -> Path:
    """`out_dir`, absolute, once a store may be written there: it does not exist, or `force` is given and it is a
    store (it holds `store_file`) or an empty directory. It is never `source`, the checkpoint the store is written
    from, nor a directory holding it. Raises FileExistsError or ValueError naming the directory otherwise, before any
    work: `force` replaces a store, never other files."""
    out = Path(out_dir).resolve()
    if source is not None:
        src = Path(source).resolve()
        if out == src or out in src.parents:
            raise ValueError(f"out_dir {str(out_dir)!r} is or holds {str(source)!r}, the checkpoint it would be "
                             "written from")
    if out.exists():
        if not force:
            raise FileExistsError(f"{out_dir} exists; pass force=True (--force) to replace it")
        if not out.is_dir():
            raise FileExistsError(f"{out_dir} exists and is not a directory: not replacing it")
        if not (out / store_file).is_file() and any(out.iterdir()):
            raise FileExistsError(f"{out_dir} holds files but no {store_file}: force replaces a store, not other "
                                  "files")
    return out


def install_dir(finished: Path, out: Path) -> None:
    """Move the directory `finished` (written beside `out`) to `out`. A store already at `out` is renamed aside
    first and removed once the new one is in place, so a failure leaves one or the other."""
    if not out.exists():
        finished.rename(out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    out.rename(old)
    finished.rename(out)
    shutil.rmtree(old)
