"""KVShard: the K/V cache of one shard (a range of (batch, kv head) pairs) on one storage directory, with delayed
writeback.

Per layer two KVFiles (`layer{l}.k`, `layer{l}.v`), each `[token][pair][head_dim]`, preallocated to the maximum
sequence length. New tokens go to a host buffer first; attention reads the disk rows and the buffer (a `KVView`
taken under the lock, so a spill finishing meanwhile never changes what one attention call sees). Each time a
layer's buffer completes a group of `writeback` tokens, a background thread spills the group in one bulk write per
file, off the critical path; the layer's next append waits for it (a whole step of the other layers later), so
the buffer stays below 2 x writeback tokens and the disk rows of each step are deterministic. `flush()`/`close()`
spill whatever is left.

Durability: a spill is done when its rows are synced (fdatasync of both files); only then does the manifest
`shard.json` record them, itself written to a temporary file, synced, renamed over the old one and the directory
synced, so after a crash the manifest never names rows the device does not hold.

A failed spill keeps the buffer (nothing is lost, attention still sees every token) and surfaces as `SpillError`
from the next call on the shard; `flush()` then retries, the manifest too if that is what failed. The manifest
`shard.json` records the rows on disk per layer after every spill (written to a temporary file and renamed), so
`KVShard.open(directory)` recovers every spilled token after a restart; with `close()` that is every token.

A folder has one owner: the shard holds an flock on `shard.lock` until it is closed, and a second shard there is
refused (ShardInUseError). The files are private to the user (0600) and never written through a symbolic link.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from flashllm_ext.errors import FormatError
from flashllm_ext.io.paths import PRIVATE_DIR_MODE, create_file, regular_file, write_atomic
from flashllm_ext.kv.files import BLOCK, FaultInjector, IOCounters, KVFile
from flashllm_ext.kv.link import Link

FORMAT_VERSION = 1
MANIFEST = "shard.json"
LOCK_FILE = "shard.lock"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class SpillError(RuntimeError):
    """A background spill failed; the buffer still holds every token it was to write (see `__cause__`)."""


class ShardInUseError(RuntimeError):
    """Another shard (in this process or another) owns the folder: two owners would overwrite each other's K/V."""


def default_writeback(token_bytes: int, min_write: int = BLOCK) -> int:
    """Steps per spill so that one spill of one file is at least `min_write` bytes (4 KiB: one block)."""
    return max(1, math.ceil(min_write / token_bytes))


@dataclass(frozen=True)
class KVView:
    """What attention of one layer sees: rows [0, disk_len) on disk, then the buffered tokens
    k_buf / v_buf [n_buf, pairs, head_dim]."""

    layer: int
    disk_len: int
    k_buf: torch.Tensor
    v_buf: torch.Tensor

    @property
    def length(self) -> int:
        return self.disk_len + self.k_buf.shape[0]


class KVShard:
    """K/V of `pairs` (batch, kv head) pairs x `n_layers` layers in `directory`, up to `max_tokens` tokens.

    writeback: tokens buffered per spill (None: `default_writeback`, one block per file and spill).
    fault_injector(path, offset, nbytes): runs before every write (tests raise OSError from it).
    device: the emulated storage device (kv/link.py) the directory stands for: every spill's write request is
    charged to it (as a write: at least its per-request cost), so the writes share the device with the reads paced
    through the same Link (None: the directory's own speed).
    Use `KVShard.create(...)` for a new shard and `KVShard.open(directory)` to reopen one.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        n_layers: int,
        pairs: int,
        head_dim: int,
        dtype: torch.dtype,
        max_tokens: int,
        *,
        create: bool,
        lengths: list[int] | None = None,
        writeback: int | None = None,
        fault_injector: FaultInjector | None = None,
        read_threads: int = 4,
        device: Link | None = None,
    ):
        if min(n_layers, pairs, head_dim, max_tokens) <= 0:
            raise ValueError(
                f"n_layers, pairs, head_dim and max_tokens must be positive, got {n_layers}, {pairs}, "
                f"{head_dim}, {max_tokens}"
            )
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype}")
        self.directory = Path(directory)
        self.n_layers, self.pairs, self.head_dim = n_layers, pairs, head_dim
        self.dtype, self.max_tokens, self.device = dtype, max_tokens, device
        self.token_bytes = pairs * head_dim * dtype.itemsize
        self.writeback = default_writeback(self.token_bytes) if writeback is None else int(writeback)
        if self.writeback < 1:
            raise ValueError(f"writeback must be >= 1 step, got {writeback}")
        lengths = lengths or [0] * n_layers
        self.directory.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        _check_no_links(self.directory)
        self._owner = _own(self.directory)  # before any file is touched: another owner's files are not ours to change
        self._files: list[tuple[KVFile, KVFile]] = []
        try:
            for layer in range(n_layers):
                self._files.append(
                    tuple(  # type: ignore[arg-type]
                        KVFile(
                            self.directory / f"layer{layer}.{kind}",
                            self.token_bytes,
                            max_tokens,
                            create=create,
                            length=lengths[layer],
                            fault_injector=fault_injector,
                            read_threads=read_threads,
                        )
                        for kind in ("k", "v")
                    )
                )
        except BaseException:
            self._close_files()
            raise
        # rows on disk as attention sees them: advanced with the buffer trim under the lock, after the write (the
        # files' own lengths move first, while the rows are still in the buffer too)
        self._disk_len = list(lengths)
        empty = torch.empty(0, pairs, head_dim, dtype=dtype)
        self._k_buf = [empty] * n_layers
        self._v_buf = [empty] * n_layers
        self._lock = threading.Lock()
        self._spiller = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashllm-kv-spill")
        self._pending: list[Future] = []
        self._last_spill: list[Future | None] = [None] * n_layers
        self._assigned = [0] * n_layers  # buffered tokens already handed to a queued spill
        self._error: BaseException | None = None
        self._manifest_stale = False  # rows are on disk that the manifest does not name yet (its write failed)
        self._closed = False
        if create:
            try:
                self._write_manifest()
            except BaseException:
                self.abandon()
                raise

    # ------------------------------------------------------------------------------------------------ lifecycle
    @classmethod
    def create(
        cls,
        directory: str | os.PathLike,
        n_layers: int,
        pairs: int,
        head_dim: int,
        dtype: torch.dtype,
        max_tokens: int,
        **kwargs,
    ) -> KVShard:
        """A new, empty shard (files fallocated to max_tokens rows); an existing shard there is replaced."""
        return cls(directory, n_layers, pairs, head_dim, dtype, max_tokens, create=True, **kwargs)

    @classmethod
    def open(cls, directory: str | os.PathLike, **kwargs) -> KVShard:
        """Reopens a shard: every token spilled before (all of them after close()) is there again."""
        _check_no_links(Path(directory))
        path = Path(directory) / MANIFEST
        try:
            meta = json.loads(Path(regular_file(path)).read_text())
        except (OSError, ValueError) as e:
            raise FormatError("manifest", f"cannot read: {e}", str(path)) from e
        if not isinstance(meta, dict):
            raise FormatError("manifest", f"must be a JSON object, got {type(meta).__name__}", str(path))
        if meta.get("format_version") != FORMAT_VERSION:
            raise FormatError(
                "format_version", f"expected {FORMAT_VERSION}, got {meta.get('format_version')}", str(path)
            )
        if meta.get("dtype") not in DTYPES:
            raise FormatError("dtype", f"unknown {meta.get('dtype')!r}", str(path))
        for key in ("n_layers", "pairs", "head_dim", "max_tokens", "writeback"):
            if type(meta.get(key)) is not int or meta[key] <= 0:
                raise FormatError(key, f"must be a positive integer, got {meta.get(key)!r}", str(path))
        lengths = meta.get("lengths")
        if (
            not isinstance(lengths, list)
            or len(lengths) != meta["n_layers"]
            or not all(type(n) is int and 0 <= n <= meta["max_tokens"] for n in lengths)
        ):
            raise FormatError(
                "lengths", f"expected one length in [0, max_tokens] per layer, got {lengths!r}", str(path)
            )
        return cls(
            directory,
            meta["n_layers"],
            meta["pairs"],
            meta["head_dim"],
            DTYPES[meta["dtype"]],
            meta["max_tokens"],
            create=False,
            lengths=lengths,
            writeback=kwargs.pop("writeback", meta["writeback"]),
            **kwargs,
        )

    def _write_manifest(self, lengths: list[int] | None = None) -> None:
        """Records `lengths` (default: the rows on disk now) durably. Writers never overlap: the spill thread, or
        the caller once the spills are waited for."""
        dtype_name = next(name for name, d in DTYPES.items() if d == self.dtype)
        meta = {
            "format_version": FORMAT_VERSION,
            "n_layers": self.n_layers,
            "pairs": self.pairs,
            "head_dim": self.head_dim,
            "dtype": dtype_name,
            "max_tokens": self.max_tokens,
            "writeback": self.writeback,
            "lengths": list(self._disk_len if lengths is None else lengths),
        }
        write_atomic(self.directory / MANIFEST, json.dumps(meta).encode(), private=True)

    def _record(self, lengths: list[int] | None = None) -> None:
        """_write_manifest, remembering a failure so that flush() and close() write it again (SpillError)."""
        try:
            self._write_manifest(lengths)
        except OSError as e:  # the rows are on disk and nothing is lost here; a restart would not see them yet
            self._manifest_stale = True
            raise SpillError(
                f"recording the rows on disk in {self.directory / MANIFEST} failed: {e}; flush() retries"
            ) from e
        self._manifest_stale = False

    def flush(self) -> None:
        """Spills every buffered token now (waits for the background spills first) and makes sure the manifest
        names every row on disk. Raises SpillError (buffer kept) on failure; call again to retry."""
        self._check_open()
        self._wait_pending()
        self._raise_error()
        for layer in range(self.n_layers):
            self._spill(layer, None)
        self._raise_error()
        if self._manifest_stale:
            self._record()

    def close(self) -> None:
        """flush(), then close the files. If the flush fails the shard stays open (nothing is lost) and raises."""
        if self._closed:
            return
        self.flush()
        self._spiller.shutdown(wait=True)
        self._close_files()
        self._closed = True

    def abandon(self) -> None:
        """Closes without spilling (the buffered tokens are dropped): for a shard whose device failed."""
        if not self._closed:
            self._spiller.shutdown(wait=True)
            self._close_files()
            self._closed = True

    def _close_files(self) -> None:
        """Closes the files, then gives up the folder."""
        for pair in self._files:
            for f in pair:
                f.close()
        os.close(self._owner)

    def __enter__(self) -> KVShard:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reset(self) -> None:
        """Forgets every token (a new batch of sequences); the files keep their space."""
        self._check_open()
        self._wait_pending()
        self._error = None
        with self._lock:
            for layer, (k, v) in enumerate(self._files):
                k.truncate(0)
                v.truncate(0)
                self._k_buf[layer] = self._k_buf[layer][:0]
                self._v_buf[layer] = self._v_buf[layer][:0]
                self._assigned[layer] = 0
                self._disk_len[layer] = 0
            self._record()

    # ------------------------------------------------------------------------------------------------ data path
    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> KVView:
        """Adds tokens k, v [n, pairs, head_dim] to `layer` and returns the view attention should use (all tokens,
        the new ones included). Schedules a background spill once `writeback` tokens are buffered. Raises
        SpillError first if an earlier spill failed (the call then changes nothing)."""
        self._check_open()
        self._check_layer(layer)
        # the previous spill of this layer ends before its next step: a view's disk rows are then exactly the
        # tokens of the groups handed to spills so far (traffic per step is deterministic), and the buffer stays
        # below 2 x writeback tokens. It had a whole step of every other layer to finish.
        if self._last_spill[layer] is not None:
            self._last_spill[layer].result()
            self._last_spill[layer] = None
        self._raise_error()
        expected = (self.pairs, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if t.dim() != 3 or tuple(t.shape[1:]) != expected or t.dtype != self.dtype or t.device.type != "cpu":
                raise ValueError(
                    f"{name} must be a CPU {self.dtype} tensor [n, {self.pairs}, {self.head_dim}], got "
                    f"{t.dtype} {tuple(t.shape)} on {t.device}"
                )
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k has {k.shape[0]} tokens, v {v.shape[0]}")
        with self._lock:
            if self._length(layer) + k.shape[0] > self.max_tokens:
                raise ValueError(
                    f"layer {layer}: {self._length(layer)} + {k.shape[0]} tokens exceed max_tokens {self.max_tokens}"
                )
            self._k_buf[layer] = torch.cat([self._k_buf[layer], k])
            self._v_buf[layer] = torch.cat([self._v_buf[layer], v])
            view = self._view(layer)
            # whole groups of `writeback` tokens not yet handed to a spill: a spill per group crossing, whatever
            # the spill thread's speed, so the number and size of writes are deterministic
            unassigned = self._k_buf[layer].shape[0] - self._assigned[layer]
            n_spill = unassigned // self.writeback * self.writeback
            self._assigned[layer] += n_spill
        if n_spill:
            self._pending = [f for f in self._pending if not f.done()]
            self._last_spill[layer] = self._spiller.submit(self._spill, layer, n_spill)
            self._pending.append(self._last_spill[layer])
        return view

    def view(self, layer: int) -> KVView:
        """The current tokens of `layer` (disk rows + buffer)."""
        self._check_open()
        self._check_layer(layer)
        with self._lock:
            return self._view(layer)

    def read(self, layer: int, t0: int, t1: int, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """Disk rows [t0, t1) of `layer` into k_out, v_out [t1 - t0, pairs, head_dim] (contiguous), direct I/O.
        Only rows of a view's disk_len are stable to read."""
        k_file, v_file = self._files[layer]
        k_file.read(t0, t1, k_out)
        v_file.read(t0, t1, v_out)

    def tokens(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token of `layer`, disk + buffer: (k, v) [length, pairs, head_dim] (tests, recovery)."""
        view = self.view(layer)
        shape = (view.disk_len, self.pairs, self.head_dim)
        k, v = torch.empty(shape, dtype=self.dtype), torch.empty(shape, dtype=self.dtype)
        self.read(layer, 0, view.disk_len, k, v)
        return torch.cat([k, view.k_buf]), torch.cat([v, view.v_buf])

    def length(self, layer: int) -> int:
        with self._lock:
            return self._length(layer)

    def buffered(self, layer: int) -> int:
        """Tokens of `layer` not yet on disk."""
        with self._lock:
            return self._k_buf[layer].shape[0]

    def counters(self) -> IOCounters:
        """Storage traffic of the shard so far (all layers, K and V, padding included)."""
        total = IOCounters()
        for pair in self._files:
            for f in pair:
                total.add(f.counters)
        return total

    # ------------------------------------------------------------------------------------------------ internals
    def _length(self, layer: int) -> int:
        return self._disk_len[layer] + self._k_buf[layer].shape[0]

    def _view(self, layer: int) -> KVView:
        return KVView(layer, self._disk_len[layer], self._k_buf[layer], self._v_buf[layer])

    def _spill(self, layer: int, n: int | None) -> None:
        """Writes the buffer's first n tokens (None: all) in one write per file. Runs on the spill thread (or in
        flush); a failure is recorded and the buffer kept."""
        queued = n is not None  # its tokens count in _assigned until they leave the buffer (or the spill fails)
        with self._lock:
            buffered = self._k_buf[layer].shape[0]
            n = buffered if n is None else n
            k, v = self._k_buf[layer][:n], self._v_buf[layer][:n]
        if n == 0:
            return
        k_file, v_file = self._files[layer]
        k_len, v_len = k_file.length, v_file.length
        try:
            try:
                for file, rows in ((k_file, k), (v_file, v)):
                    nbytes = file.append(rows)
                    if self.device is not None:  # the request takes the device's time before it is done
                        self.device.transfer(nbytes, write=True)
                k_file.sync()  # durable before the manifest below says so
                v_file.sync()
            except BaseException:
                k_file.truncate(k_len)  # K and V stay the same length: the rows go again next time
                v_file.truncate(v_len)
                raise
        except OSError as e:
            with self._lock:
                self._assigned[layer] -= n if queued else 0
            if self._error is None:
                self._error = SpillError(
                    f"spilling {n} tokens of layer {layer} to {self.directory} failed: {e}; "
                    f"the {buffered} buffered tokens are kept (flush() retries)"
                )
                self._error.__cause__ = e
            return
        with self._lock:
            self._k_buf[layer] = self._k_buf[layer][n:]
            self._v_buf[layer] = self._v_buf[layer][n:]
            self._disk_len[layer] += n
            self._assigned[layer] -= n if queued else 0
            lengths = list(self._disk_len)
        try:  # outside the lock: its syncs must not hold up attention's views
            self._record(lengths)
        except SpillError as e:
            if self._error is None:
                self._error = e

    def _wait_pending(self) -> None:
        for future in self._pending:
            future.result()
        self._pending = []
        self._last_spill = [None] * self.n_layers

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"KV shard {self.directory} is closed")

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer {layer} outside [0, {self.n_layers})")

    def __repr__(self) -> str:
        return (
            f"KVShard({str(self.directory)!r}, layers={self.n_layers}, pairs={self.pairs}, "
            f"head_dim={self.head_dim}, {self.dtype}, max_tokens={self.max_tokens}, writeback={self.writeback})"
        )


def _check_no_links(directory: Path) -> None:
    """A KV folder holds the shard's own files only: a symbolic link there (planted to make the shard overwrite its
    target) is refused before anything is read or written."""
    if directory.is_dir():
        for entry in os.scandir(directory):
            if entry.is_symlink():
                raise ValueError(
                    f"{directory}: {entry.name} is a symbolic link; a KV folder holds only its shard's "
                    "files, and no file is written through a link"
                )


def _own(directory: Path) -> int:
    """Takes the folder's lock (flock on LOCK_FILE, released when its descriptor closes, or the process ends);
    returns the descriptor. ShardInUseError if another shard holds it."""
    fd = create_file(directory / LOCK_FILE, private=True, exclusive=False)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ShardInUseError(
            f"KV folder {directory} is in use by another shard (it holds {LOCK_FILE}'s lock); "
            "give each shard a folder of its own"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def split_pairs(n_pairs: int, n_shards: int) -> list[tuple[int, int]]:
    """Contiguous (batch, kv head) pair ranges [start, end) of n_shards shards, sizes differing by at most one."""
    if not 1 <= n_shards <= n_pairs:
        raise ValueError(f"need 1 <= n_shards <= {n_pairs} pairs, got {n_shards}")
    base, extra = divmod(n_pairs, n_shards)
    bounds = [0]
    for s in range(n_shards):
        bounds.append(bounds[-1] + base + (s < extra))
    return list(zip(bounds[:-1], bounds[1:]))
