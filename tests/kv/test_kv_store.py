"""KVFile and KVShard: the on-disk layout, direct-I/O appends with tail blocks, delayed writeback, faults, restart."""

import errno
import json
import os

import pytest
import torch

from flashllm_ext import FormatError
from flashllm_ext.kv import KVFile, KVShard, ShardInUseError, SpillError, default_writeback, split_pairs
from flashllm_ext.kv.files import BLOCK
from tests.helpers.faults import refuses_without_blocking


def rand_tokens(n, pairs, dim, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, pairs, dim, generator=g).to(dtype)


@pytest.mark.parametrize("row_bytes", [96, 4096, 5000])
def test_kvfile_appends_of_any_size_read_back(tmp_path, row_bytes):
    f = KVFile(tmp_path / "x", row_bytes, 40, create=True)
    rows = torch.randint(0, 255, (40, row_bytes), dtype=torch.uint8)
    pos = 0
    for n in (1, 3, 0, 7, 1, 20, 8):
        f.append(rows[pos : pos + n])
        pos += n
    out = torch.empty(pos, row_bytes, dtype=torch.uint8)
    f.read(0, pos, out)
    assert torch.equal(out, rows[:pos])
    # every write starts and ends on a block: the rewritten tail and the zero padding are counted
    assert f.counters.bytes_written % BLOCK == 0 and f.counters.n_writes == 6
    part = torch.empty(5, row_bytes, dtype=torch.uint8)
    f.read(3, 8, part)
    assert torch.equal(part, rows[3:8])
    with pytest.raises(ValueError, match="exceed the preallocated"):
        f.append(rows[:1].repeat(5, 1))
    with pytest.raises(ValueError, match="outside"):
        f.read(0, pos + 1, torch.empty(pos + 1, row_bytes, dtype=torch.uint8))
    f.close()


def test_kvfile_is_preallocated(tmp_path):
    f = KVFile(tmp_path / "x", 100, 1000, create=True)
    assert (tmp_path / "x").stat().st_size == 102400 and (tmp_path / "x").stat().st_blocks * 512 >= 100000
    f.close()


def test_shard_layout_and_writeback(tmp_path):
    pairs, dim = 3, 8  # 48 bytes per token: default writeback 86 steps for a 4 KiB spill
    assert default_writeback(pairs * dim * 2) == 86
    shard = KVShard.create(tmp_path, 2, pairs, dim, torch.float16, 64, writeback=4)
    k, v = rand_tokens(23, pairs, dim, seed=1), rand_tokens(23, pairs, dim, seed=2)
    shard.append(0, k[:5], v[:5])  # prefill of 5: 4 spilled in bulk, 1 stays
    for t in range(5, 23):
        view = shard.append(0, k[t : t + 1], v[t : t + 1])
        assert view.length == t + 1
    shard.flush()
    assert shard.buffered(0) == 0 and shard.length(0) == 23
    got_k, got_v = shard.tokens(0)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    # the file is [token][pair][head_dim]: row t is token t of every pair
    raw = (tmp_path / "layer0.k").read_bytes()[: 23 * pairs * dim * 2]
    assert torch.equal(torch.frombuffer(bytearray(raw), dtype=torch.float16).view(23, pairs, dim), k)
    # spills: 4 (prefill) + 4 x 4 steps + the flush of the last 2: 6 writes per file
    assert shard.counters().n_writes == 2 * 6
    shard.close()


def test_views_are_stable_while_spilling(tmp_path):
    shard = KVShard.create(tmp_path, 1, 2, 4, torch.float32, 100, writeback=1)
    k = rand_tokens(30, 2, 4, torch.float32)
    views = [shard.append(0, k[t : t + 1], k[t : t + 1]) for t in range(30)]
    shard.flush()
    for t, view in enumerate(views):  # each view: its disk rows then its buffer, exactly tokens [0, t]
        disk = torch.empty(view.disk_len, 2, 4)
        shard.read(0, 0, view.disk_len, disk, disk.clone())
        assert torch.equal(torch.cat([disk, view.k_buf]), k[: t + 1])
    shard.close()


def append_rest_and_reopen(path, shard, k, v, start: int) -> None:
    """After a failure is switched off: append layer 0's tokens start.. of k / v, close, reopen from `path`; every
    token must be there (nothing the failure kept in the buffer was lost)."""
    for t in range(start, k.shape[0]):
        shard.append(0, k[t : t + 1], v[t : t + 1])
    shard.close()
    reopened = KVShard.open(path)
    got_k, got_v = reopened.tokens(0)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    reopened.close()


def inject(errno_code, fail_after=0):
    calls = {"n": 0, "on": True}

    def hook(path, offset, nbytes):
        calls["n"] += 1
        if calls["on"] and calls["n"] > fail_after:
            raise OSError(errno_code, "injected")

    return hook, calls


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("fail_after", [0, 1])  # fail on K's write, or on V's after K's succeeded
def test_failed_spill_keeps_buffer_and_surfaces(tmp_path, code, fail_after):
    hook, calls = inject(code, fail_after)
    shard = KVShard.create(tmp_path, 1, 2, 4, torch.float16, 50, writeback=3, fault_injector=hook)
    k, v = rand_tokens(10, 2, 4, seed=3), rand_tokens(10, 2, 4, seed=4)
    for t in range(3):
        shard.append(0, k[t : t + 1], v[t : t + 1])
    with pytest.raises(SpillError, match="3 buffered tokens are kept") as info:
        shard.flush()
    assert info.value.__cause__.errno == code and "offset" in str(info.value)
    assert shard.buffered(0) == 3 and shard.view(0).disk_len == 0
    got_k, got_v = shard.tokens(0)
    assert torch.equal(got_k, k[:3]) and torch.equal(got_v, v[:3])
    with pytest.raises(SpillError):
        shard.close()  # close refuses to drop the buffer
    calls["on"] = False
    append_rest_and_reopen(tmp_path, shard, k, v, 3)


def test_background_spill_error_surfaces_on_next_append(tmp_path):
    hook, calls = inject(errno.ENOSPC)
    shard = KVShard.create(tmp_path, 1, 2, 4, torch.float16, 50, writeback=2, fault_injector=hook)
    k = rand_tokens(4, 2, 4)
    shard.append(0, k[:2], k[:2])  # schedules the failing spill
    shard._wait_pending()
    with pytest.raises(SpillError):
        shard.append(0, k[2:3], k[2:3])
    assert shard.length(0) == 2  # the failed call changed nothing
    calls["on"] = False
    shard.append(0, k[2:4], k[2:4])
    shard.close()


class SyncLog:
    """Watches os.pwrite / os.fdatasync / os.fsync / os.replace: which bytes of each file were written and then
    synced, and what each manifest claimed when it was renamed into place (checked against the synced bytes)."""

    def __init__(self, monkeypatch, row_bytes, fail_sync=None):
        self.row_bytes, self.fail_sync = row_bytes, fail_sync
        self.written, self.synced, self.events = {}, {}, []
        real = {name: getattr(os, name) for name in ("pwrite", "fdatasync", "fsync", "replace")}

        def path_of(fd):
            return os.readlink(f"/proc/self/fd/{fd}")

        def pwrite(fd, buf, offset):
            n = real["pwrite"](fd, buf, offset)
            path = path_of(fd)
            self.written[path] = max(self.written.get(path, 0), offset + n)
            return n

        def fdatasync(fd):
            path = path_of(fd)
            if self.fail_sync is not None and self.fail_sync(path):
                raise OSError(errno.EIO, "injected")
            real["fdatasync"](fd)
            self.synced[path] = self.written.get(path, 0)
            self.events.append(("sync", path))

        def fsync(fd):
            real["fsync"](fd)
            self.events.append(("fsync", path_of(fd)))

        def replace(src, dst):
            lengths = json.loads(open(src).read())["lengths"]
            assert self.events[-1] == ("fsync", str(src)), "the manifest is synced before it replaces the old one"
            for layer, n in enumerate(lengths):  # every row the manifest names is on the device
                for kind in "kv":
                    path = str(os.path.join(os.path.dirname(dst), f"layer{layer}.{kind}"))
                    assert self.synced.get(path, 0) >= n * self.row_bytes, (path, n, self.synced)
            real["replace"](src, dst)
            self.events.append(("manifest", tuple(lengths)))

        for name, fn in (("pwrite", pwrite), ("fdatasync", fdatasync), ("fsync", fsync), ("replace", replace)):
            monkeypatch.setattr(os, name, fn)


def test_spills_are_synced_before_the_manifest_records_them(tmp_path, monkeypatch):
    pairs, dim = 3, 8
    log = SyncLog(monkeypatch, pairs * dim * 2)
    shard = KVShard.create(tmp_path, 2, pairs, dim, torch.float16, 64, writeback=4)
    k = rand_tokens(19, pairs, dim)
    for t in range(19):
        for layer in range(2):
            shard.append(layer, k[t : t + 1], -k[t : t + 1])
    shard.close()
    manifests = [e[1] for e in log.events if e[0] == "manifest"]
    # creation, one per spill (4 per layer in the loop, then the flush of the last 3 per layer)
    assert manifests[0] == (0, 0) and manifests[-1] == (19, 19) and len(manifests) == 1 + 2 * 4 + 2
    # the rename is made durable too: a directory fsync after each manifest
    for i, event in enumerate(log.events):
        if event[0] == "manifest":
            assert log.events[i + 1] == ("fsync", str(tmp_path))


def test_failed_sync_keeps_buffer_and_rows_go_again(tmp_path, monkeypatch):
    """fdatasync failing (EIO) is a failed spill: the buffer stays, the manifest is not advanced, the files are
    rolled back so a retry writes the rows again; after it every token is recovered from disk."""
    fail = {"on": True}
    SyncLog(monkeypatch, 2 * 4 * 2, fail_sync=lambda path: fail["on"] and path.endswith(".v"))
    shard = KVShard.create(tmp_path, 1, 2, 4, torch.float16, 50, writeback=3)
    k, v = rand_tokens(8, 2, 4, seed=5), rand_tokens(8, 2, 4, seed=6)
    for t in range(3):
        shard.append(0, k[t : t + 1], v[t : t + 1])
    with pytest.raises(SpillError, match="sync of .*layer0.v failed") as info:
        shard.flush()
    assert info.value.__cause__.errno == errno.EIO
    assert shard.buffered(0) == 3 and shard.view(0).disk_len == 0
    assert json.loads((tmp_path / "shard.json").read_text())["lengths"] == [0]
    fail["on"] = False
    append_rest_and_reopen(tmp_path, shard, k, v, 3)


def test_restart_recovers_spilled_tokens_and_tail(tmp_path):
    pairs, dim = 5, 6  # 60-byte rows: the last block on disk is partial
    shard = KVShard.create(tmp_path, 3, pairs, dim, torch.bfloat16, 200, writeback=7)
    ks = [rand_tokens(90, pairs, dim, torch.bfloat16, seed=layer) for layer in range(3)]
    for t in range(90):
        for layer in range(3):
            shard.append(layer, ks[layer][t : t + 1], -ks[layer][t : t + 1])
    shard._wait_pending()
    spilled = [shard.view(layer).disk_len for layer in range(3)]
    assert spilled == [84] * 3
    # a crash now loses only the buffer: the manifest names what is on disk
    meta = json.loads((tmp_path / "shard.json").read_text())
    assert meta["lengths"] == spilled
    shard.close()
    again = KVShard.open(tmp_path)
    for layer in range(3):
        k, v = again.tokens(layer)
        assert torch.equal(k, ks[layer]) and torch.equal(v, -ks[layer])
    # appending after a restart keeps the partial tail block intact
    extra = rand_tokens(3, pairs, dim, torch.bfloat16, seed=9)
    again.append(0, extra, extra)
    again.flush()
    assert torch.equal(again.tokens(0)[0], torch.cat([ks[0], extra]))
    again.reset()
    assert again.length(0) == 0
    again.close()


def test_bad_inputs(tmp_path):
    shard = KVShard.create(tmp_path, 1, 2, 4, torch.float16, 4)
    with pytest.raises(ValueError, match="must be a CPU"):
        shard.append(0, torch.zeros(1, 2, 4), torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match="layer 1 outside"):
        shard.append(1, torch.zeros(1, 2, 4, dtype=torch.float16), torch.zeros(1, 2, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="exceed max_tokens"):
        shard.append(0, torch.zeros(5, 2, 4, dtype=torch.float16), torch.zeros(5, 2, 4, dtype=torch.float16))
    shard.close()
    with pytest.raises(ValueError, match="closed"):
        shard.view(0)
    (tmp_path / "shard.json").write_text("{}")
    with pytest.raises(ValueError, match="format_version"):
        KVShard.open(tmp_path)


def test_split_pairs():
    assert split_pairs(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split_pairs(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError):
        split_pairs(2, 3)


def test_failed_manifest_write_is_retried_by_flush_and_close(tmp_path, monkeypatch):
    """The rows of a spill are on disk but the manifest naming them could not be written (ENOSPC): the next call
    reports it, and flush()/close() write it again even with nothing left to spill, so a reopen sees every row."""
    full = {"on": False}
    real = KVShard._write_manifest

    def write_manifest(self, *args, **kwargs):
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(KVShard, "_write_manifest", write_manifest)
    shard = KVShard.create(tmp_path, 1, 2, 4, torch.float16, 50, writeback=2)
    k = rand_tokens(2, 2, 4)
    full["on"] = True
    shard.append(0, k, -k)  # the background spill writes the rows, then fails on the manifest
    with pytest.raises(SpillError, match="No space left"):
        shard.flush()
    assert shard.buffered(0) == 0 and shard.view(0).disk_len == 2
    with pytest.raises(SpillError, match="No space left"):
        shard.flush()  # still not recorded: said again, not skipped
    full["on"] = False
    shard.close()
    reopened = KVShard.open(tmp_path)
    got_k, got_v = reopened.tokens(0)
    assert torch.equal(got_k, k) and torch.equal(got_v, -k)
    reopened.close()


def test_create_never_writes_through_planted_symlinks(tmp_path):
    """Links planted at the names a shard writes (its layer files, its manifest and the manifest's temporary file)
    are refused before anything is written, and their targets stay untouched."""
    victim = tmp_path / "victim"
    for planted in ("layer0.k", "layer0.v", "shard.json", "shard.json.tmp"):
        victim.write_text("precious")
        d = tmp_path / f"kv-{planted}"
        d.mkdir()
        (d / planted).symlink_to(victim)
        with pytest.raises(ValueError, match=f"{planted}.*symbolic link"):
            KVShard.create(d, 1, 2, 4, torch.float16, 50)
        with pytest.raises(ValueError, match=f"{planted}.*symbolic link"):
            KVShard.open(d)
        assert victim.read_text() == "precious"
    (tmp_path / "link").symlink_to(victim)
    with pytest.raises(OSError):  # reopened: not followed
        KVFile(tmp_path / "link", 16, 4, create=False)
    KVFile(tmp_path / "link", 16, 4, create=True).close()  # created: a new file in the link's place
    assert victim.read_text() == "precious" and not (tmp_path / "link").is_symlink()


def test_kv_files_are_private_to_the_user(tmp_path, umask):
    """K/V derive from users' prompts: every file of a shard is 0600 (its folder 0700) whatever the umask."""
    umask(0)
    shard = KVShard.create(tmp_path / "kv", 2, 2, 4, torch.float16, 50, writeback=1)
    shard.append(0, rand_tokens(1, 2, 4), rand_tokens(1, 2, 4))
    shard.close()
    assert (tmp_path / "kv").stat().st_mode & 0o777 == 0o700
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "kv").iterdir()}
    assert "layer1.v" in modes and "shard.json" in modes
    assert set(modes.values()) == {0o600}, modes


def test_a_shard_folder_has_one_owner(tmp_path):
    """A second shard on a folder in use (it would read and overwrite the first one's K/V) is refused at once,
    created or reopened; closing (or abandoning) the first releases the folder."""
    first = KVShard.create(tmp_path, 1, 2, 4, torch.float16, 50)
    k = rand_tokens(3, 2, 4)
    first.append(0, k, k)
    for open_second in (lambda: KVShard.create(tmp_path, 1, 2, 4, torch.float16, 50), lambda: KVShard.open(tmp_path)):
        with pytest.raises(ShardInUseError, match=f"{tmp_path}.* in use"):
            open_second()
    assert torch.equal(first.tokens(0)[0], k)  # the refused one changed nothing
    first.close()
    second = KVShard.open(tmp_path)
    assert torch.equal(second.tokens(0)[0], k)
    second.abandon()
    KVShard.open(tmp_path).close()


@pytest.mark.parametrize("name", ["shard.json", "layer0.k"])
def test_open_refuses_a_fifo_in_the_shard(tmp_path, name):
    KVShard.create(tmp_path, 1, 2, 4, torch.float16, 4).close()
    (tmp_path / name).unlink()
    os.mkfifo(tmp_path / name)
    refuses_without_blocking(lambda: KVShard.open(tmp_path), tmp_path / name)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda m: [m], "manifest: must be a JSON object"),
        (lambda m: {k: v for k, v in m.items() if k != "pairs"}, "pairs: must be a positive integer, got None"),
        (lambda m: {**m, "pairs": "2"}, "pairs: must be a positive integer"),
        (lambda m: {**m, "writeback": 0}, "writeback: must be a positive integer"),
        (lambda m: {**m, "lengths": [1.5]}, "lengths: expected one length"),
        (lambda m: {**m, "lengths": [5]}, "lengths: expected one length"),
        (lambda m: {**m, "lengths": None}, "lengths: expected one length"),
    ],
    ids=["list", "no_pairs", "pairs_str", "writeback_0", "float_length", "length_past_max", "no_lengths"],
)
def test_open_refuses_a_manifest_of_wrong_types(tmp_path, edit, match):
    KVShard.create(tmp_path, 1, 2, 4, torch.float16, 4).close()
    manifest = tmp_path / "shard.json"
    manifest.write_text(json.dumps(edit(json.loads(manifest.read_text()))))
    with pytest.raises(FormatError, match=f"shard.json: {match}"):
        KVShard.open(tmp_path)
