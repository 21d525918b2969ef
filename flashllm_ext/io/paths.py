"""Where flashllm_ext keeps what it downloads, measures or generates (one cache directory for everything), and how
it creates files: every file the library writes itself goes through `create_file`, so none is written through a
symbolic link planted at its name, and one rule sets the modes: K/V and scratch files are private to the user
(0600), stores, profiles and downloads take the user's umask."""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flashllm_ext.errors import FormatError

PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700
_STAGING = ".tmp-"  # a store is written to .<out>.tmp-<pid>-<random> beside <out>, then renamed


def resolve_cache_dir(path: str | os.PathLike | None = None) -> Path:
    """The cache directory: `path`, else $FLASHLLM_CACHE, else ~/.cache/flashllm_ext (created if missing)."""
    chosen = Path(path or os.environ.get("FLASHLLM_CACHE") or Path.home() / ".cache" / "flashllm_ext")
    chosen.mkdir(parents=True, exist_ok=True)
    return chosen


def create_file(path: str | os.PathLike, *, private: bool, exclusive: bool = True) -> int:
    """A read-write descriptor of a new file at `path` (exclusive: it must not exist; otherwise an existing regular
    file is truncated). Never follows a symbolic link at `path` (O_NOFOLLOW, and O_EXCL refuses even a dangling
    one), so a link planted at a predictable name cannot redirect the write. private: mode 0600 (K/V derive from
    users' prompts); else 0666 less the umask."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_EXCL if exclusive else os.O_TRUNC)
    return os.open(path, flags, PRIVATE_FILE_MODE if private else 0o666)


def write_atomic(path: str | os.PathLike, data: bytes, *, private: bool) -> None:
    """Replaces `path` by a file holding `data`, durably: written to a new file beside it (create_file, a name of
    its own), synced, renamed over `path`, the directory synced; a crash leaves the old file or the new one."""
    path = Path(path)
    tmp = _staging_name(path)
    try:
        with os.fdopen(create_file(tmp, private=private), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)  # the rename itself
    finally:
        os.close(fd)


def _staging_name(path: Path) -> Path:
    """A name beside `path` no other writer uses (this process's id and random bytes)."""
    return path.with_name(f".{path.name}{_STAGING}{os.getpid()}-{secrets.token_hex(4)}")


@contextmanager
def staged_file(path: str | os.PathLike) -> Iterator[Path]:
    """A new empty file beside `path` (create_file, a name of its own) for the block to write by name; renamed over
    `path` when the block ends, removed if it raises: a reader of `path` never meets a partial file."""
    path = Path(path)
    tmp = _staging_name(path)
    os.close(create_file(tmp, private=False))
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def scratch_file(directory: str | os.PathLike, name: str) -> Iterator[Path]:
    """A new empty private file `name` inside a private folder (0700, a name no one can predict) made in
    `directory`; both are removed on exit. For measurements that must write on a given disk."""
    with tempfile.TemporaryDirectory(prefix=".flashllm-", dir=directory) as folder:
        path = Path(folder) / name
        os.close(create_file(path, private=True))
        yield path


def regular_file(path: str | os.PathLike, field: str = "file") -> str:
    """`path` as a string once it names a regular file (links followed). Every loader calls it before opening a
    file: open() of a FIFO blocks until a writer appears, and a device or socket streams without end. Raises
    FileNotFoundError (or another OSError) when it cannot be looked up, FormatError naming `field` otherwise."""
    path = os.fspath(path)
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = (
            "a FIFO"
            if stat.S_ISFIFO(mode)
            else "a directory"
            if stat.S_ISDIR(mode)
            else "a socket"
            if stat.S_ISSOCK(mode)
            else "a device"
        )
        raise FormatError(field, f"is {kind}, not a regular file", path)
    return path


def check_out_dir(
    out_dir: str | os.PathLike, force: bool, store_files: tuple[str, ...], source: str | os.PathLike | None = None
) -> Path:
    """`out_dir`, absolute, once a store may be written there: it does not exist, or `force` is given and it is an
    empty directory or a store (it holds `store_files[0]`) holding nothing but `store_files`. It is never `source`,
    the checkpoint the store is written from, nor a directory holding it. Raises FileExistsError or ValueError
    naming the directory (and the first file that is not the store's) otherwise, before any work: `force` replaces
    a store's files, never other files."""
    out = Path(out_dir).resolve()
    if source is not None:
        src = Path(source).resolve()
        if out == src or out in src.parents:
            raise ValueError(
                f"out_dir {str(out_dir)!r} is or holds {str(source)!r}, the checkpoint it would be written from"
            )
    if out.exists():
        if not force:
            raise FileExistsError(f"{out_dir} exists; pass force=True (--force) to replace it")
        if not out.is_dir():
            raise FileExistsError(f"{out_dir} exists and is not a directory: not replacing it")
        names = sorted(p.name for p in out.iterdir())
        if names and store_files[0] not in names:
            raise FileExistsError(
                f"{out_dir} holds files but no {store_files[0]}: force replaces a store, not other files"
            )
        others = [n for n in names if n not in store_files]
        if others:
            raise FileExistsError(
                f"{out_dir} holds {others[0]!r}, which is not a file of the store: force replaces "
                "a store's own files only (move it out first)"
            )
    return out


def staging_dir(out: Path) -> Path:
    """A new folder beside `out` to write a store into (install_dir then moves it to `out`), named after this
    process. Staging folders for `out` left by processes that are gone (a killed convert) are removed first; those
    of live processes are named in a warning and left alone."""
    prefix = f".{out.name}{_STAGING}"
    out.parent.mkdir(parents=True, exist_ok=True)
    for entry in os.scandir(out.parent):
        if not entry.name.startswith(prefix) or not entry.is_dir(follow_symlinks=False):
            continue
        pid = entry.name[len(prefix) :].partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(entry.path)
        else:
            warnings.warn(
                f"{entry.path}: a staging folder of another process writing {out} (or left by one); not removed",
                stacklevel=3,
            )
    path = out.parent / f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir(mode=0o777)  # less the umask: the mode of the store's folder
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def install_dir(finished: Path, out: Path, store_files: tuple[str, ...]) -> None:
    """Move the directory `finished` (written beside `out`) to `out`. A store already at `out` is renamed aside
    first and removed once the new one is in place, so a failure leaves one or the other; the folder keeps its mode,
    and a file that is not the store's (put there while the new store was written) is moved into the new folder,
    never removed."""
    if not out.exists():
        finished.rename(out)
        return
    finished.chmod(stat.S_IMODE(out.stat().st_mode))
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    out.rename(old)
    finished.rename(out)
    for entry in os.scandir(old):
        if entry.name not in store_files:
            os.rename(entry.path, out / entry.name)
    shutil.rmtree(old)
