import ctypes
import errno
import json
import os
import shutil
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashllm_ext import FormatError, cli
from flashllm_ext.io import disk
from flashllm_ext.flash import calibrate, reader, store
from flashllm_ext.flash.convert import convert
from flashllm_ext.flash.reader import FlashReader, ReadResult, has_io_uring, shared_reader
from tests.helpers.faults import refuses_without_blocking
from tests.helpers.models import tiny_model

ENGINES = ["threads"] + (["io_uring"] if has_io_uring() else [])


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    """A Llama store with 700 neurons of 384 bytes per layer, on the repository's disk (O_DIRECT capable)."""
    model = tiny_model("llama", intermediate_size=700, vocab_size=64)
    root = tmp_path_factory.mktemp("reader")
    model.save_pretrained(root / "ckpt")
    return convert(root / "ckpt", root / "store", progress=False)


@pytest.fixture(scope="module")
def flash_store(store_dir):
    return store.FlashStore(store_dir)


def _id_sets(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "sorted": torch.randperm(n, generator=g)[:90].sort().values,
        "unsorted": torch.randperm(n, generator=g)[:90],
        "repeated": torch.randint(0, n, (200,), generator=g),
        "empty": torch.empty(0, dtype=torch.int64),
        "all": torch.arange(n),
        "ends": torch.tensor([n - 1, 0, n - 1]),
        "dense_run": torch.arange(100, 180),
    }


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("threads", [1, 3, 32])
@pytest.mark.parametrize("coalescing", [(0, 0), (32 << 10, 64 << 10)], ids=["no_coalescing", "coalescing"])
def test_reader_matches_buffered_reads(flash_store, engine, threads, coalescing):
    min_read, max_gap = coalescing
    with FlashReader(flash_store, threads=threads, engine=engine, min_read=min_read, max_gap=max_gap) as r:
        for name, ids in _id_sets(flash_store.n_neurons).items():
            for layer in range(flash_store.n_layers):
                out, stats = r.read(layer, ids)
                assert torch.equal(out, flash_store.bundle(layer, ids)), (name, layer)
                _check_stats(stats, ids, flash_store.row_bytes)


def _check_stats(stats: reader.ReadStats, ids: torch.Tensor, row_bytes: int) -> None:
    unique = torch.unique(ids).numel()
    assert stats.bytes_requested == unique * row_bytes
    assert stats.bytes_read >= stats.bytes_requested
    assert stats.n_reads <= unique
    assert (stats.n_reads == 0) == (unique == 0)
    assert stats.wall_s > 0


def test_coalescing_follows_the_gap_rule(flash_store):
    row = flash_store.row_bytes  # 384 bytes
    ids = torch.tensor([10, 11, 12, 20, 21, 400])  # runs {10-12}, {20-21}, {400}; gaps of 7 and 378 rows
    with FlashReader(flash_store, threads=2, min_read=0, max_gap=-1) as r:
        assert r.read(0, ids).stats.n_reads == 6  # coalescing off: even adjacent neurons are separate reads
    with FlashReader(flash_store, threads=2, min_read=0, max_gap=0) as r:
        assert r.read(0, ids).stats.n_reads == 3
    with FlashReader(flash_store, threads=2, min_read=0, max_gap=7 * row) as r:
        assert r.read(0, ids).stats.n_reads == 2
    with FlashReader(flash_store, threads=2, min_read=0, max_gap=400 * row) as r:
        out, stats = r.read(0, ids)
        assert stats.n_reads == 1 and torch.equal(out, flash_store.bundle(0, ids))
    with FlashReader(flash_store, threads=2, min_read=12 * row, max_gap=0) as r:
        # The first read is short enough to absorb the second run, not the far neuron.
        assert r.read(0, ids).stats.n_reads == 2
    with FlashReader(flash_store, threads=2, min_read=0, max_gap=1 << 30, max_read=8192) as r:
        out, stats = r.read(0, torch.arange(flash_store.n_neurons))
        assert stats.n_reads == -(-flash_store.n_neurons // (8192 // row))
        assert torch.equal(out, flash_store.bundle(0, torch.arange(flash_store.n_neurons)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ids=st.lists(st.integers(0, 699), max_size=300),
    layer=st.integers(0, 1),
    max_gap=st.sampled_from([0, 384, 4096, 1 << 20]),
    min_read=st.sampled_from([0, 4096, 32 << 10]),
    engine=st.sampled_from(ENGINES),
)
def test_random_id_sets(flash_store, ids, layer, max_gap, min_read, engine):
    ids = torch.tensor(ids, dtype=torch.int64)
    with FlashReader(flash_store, threads=4, engine=engine, min_read=min_read, max_gap=max_gap) as r:
        out, stats = r.read(layer, ids)
        assert torch.equal(out, flash_store.bundle(layer, ids))
        _check_stats(stats, ids, flash_store.row_bytes)


def test_out_argument_and_bad_arguments(flash_store):
    with FlashReader(flash_store, threads=2) as r:
        out = torch.full((3, flash_store.bundle_width), 7.0, dtype=torch.float16)
        assert r.read(1, [5, 1, 5], out).data is out
        assert torch.equal(out, flash_store.bundle(1, [5, 1, 5]))
        with pytest.raises(RuntimeError, match="outside"):
            r.read(0, [0, flash_store.n_neurons])
        with pytest.raises(RuntimeError, match="outside"):
            r.read(0, [-1])
        with pytest.raises(ValueError, match="layer"):
            r.read(2, [0])
        with pytest.raises(ValueError, match="shape"):
            r.read(0, [0, 1], torch.empty((3, flash_store.bundle_width), dtype=torch.float16))
        with pytest.raises(ValueError, match="float16"):
            r.read(0, [0], torch.empty((1, flash_store.bundle_width), dtype=torch.float32))
        with pytest.raises(ValueError, match="contiguous"):
            r.read(0, [0, 1], torch.empty((flash_store.bundle_width, 2), dtype=torch.float16).t())
        with pytest.raises(RuntimeError, match="bytes"):
            r.read_rows(0, 384, 10, torch.tensor([1]), torch.empty(100, dtype=torch.uint8))
        with pytest.raises(RuntimeError, match="overflows"):
            r.read_rows(1 << 62, 1 << 40, 1 << 30, torch.tensor([1]), torch.empty(0, dtype=torch.uint8))
        assert torch.equal(r.read(0, [3]).data, flash_store.bundle(0, [3]))  # still usable after every error


def test_bad_construction(tmp_path, flash_store):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        FlashReader.for_file(tmp_path / "nope")
    with pytest.raises(FormatError, match="a directory, not a regular file"):
        FlashReader.for_file(tmp_path)
    with pytest.raises(RuntimeError, match="threads"):
        FlashReader(flash_store, threads=0)
    with pytest.raises(RuntimeError, match="engine"):
        FlashReader(flash_store, engine="aio")
    with pytest.raises(ValueError, match="exactly one"):
        FlashReader(None)


@pytest.mark.parametrize("engine", ENGINES)
def test_file_truncated_behind_the_readers_back(store_dir, tmp_path, engine):
    copy = shutil.copytree(store_dir, tmp_path / "s")
    fs = store.FlashStore(copy)
    with FlashReader(fs, threads=8, engine=engine) as r:
        tail = fs.layer_location(1)
        with open(fs.bundles_path, "r+b") as f:
            f.truncate(tail.offset + 100 * tail.row_bytes + 10)
        with pytest.raises(RuntimeError, match=rf"{fs.bundles_path} at offset \d+.*errno"):
            r.read(1, torch.arange(150, 700, 5))
        with pytest.raises(RuntimeError, match="end of file"):
            r.read_async(1, [600]).result(timeout=30)
        # Neurons before the cut and the other layer still read correctly: nothing is left stuck.
        assert torch.equal(r.read(1, torch.arange(0, 100)).data, fs.bundle(1, torch.arange(0, 100)))
        assert torch.equal(r.read(0, torch.arange(700)).data, fs.bundle(0, torch.arange(700)))


@pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="O_DIRECT is Linux's; elsewhere the reader reads buffered and says so in .direct",
)
def test_direct_io_on_linux(flash_store):
    with FlashReader(flash_store, threads=2) as r:
        assert r.direct


def test_tmpfs(flash_store, tmp_path):
    """/dev/shm: recent kernels accept O_DIRECT on tmpfs; older ones refuse it and the reader falls back to
    buffered reads. Either way the data is right and `direct` says which mode is in use."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm (a Linux tmpfs)")
    target = f"/dev/shm/flashllm-test-{os.getpid()}"
    shutil.copytree(flash_store.path, target)
    try:
        with FlashReader(target, threads=4) as r:
            ids = torch.randint(0, 700, (64,))
            assert torch.equal(r.read(1, ids).data, flash_store.bundle(1, ids))
            assert isinstance(r.direct, bool)
    finally:
        shutil.rmtree(target)


def test_buffered_mode(flash_store):
    with FlashReader(flash_store, threads=4, direct=False) as r:
        assert not r.direct
        ids = torch.randint(0, 700, (64,))
        assert torch.equal(r.read(0, ids).data, flash_store.bundle(0, ids))


def test_read_async_overlaps_python_work(tmp_path):
    """The GIL is released during I/O: a Python thread keeps running while a large read is in flight."""
    path = tmp_path / "big.bin"
    calibrate.make_test_file(path, 64 << 20)
    with FlashReader.for_file(path, threads=1, min_read=0, max_gap=-1) as r:
        counter, stop = [0], threading.Event()

        def spin():
            while not stop.is_set():
                counter[0] += 1

        spinner = threading.Thread(target=spin)
        spinner.start()
        time.sleep(0.05)
        before = counter[0]
        stats = calibrate.random_read_throughput(r, 64 << 20, 4096, 4000)
        during = counter[0] - before
        stop.set()
        spinner.join()
    assert stats.n_reads == 4000 and stats.bytes_read == 4000 * 4096
    # Held GIL: the spinner would get at most a switch interval (5 ms) of turns per read call.
    assert during > 10_000, during


def test_read_async_returns_future(flash_store):
    with FlashReader(flash_store, threads=4) as r:
        ids = torch.arange(0, 700, 3)
        futures = [r.read_async(layer, ids) for layer in (0, 1, 0)]
        for layer, fut in zip((0, 1, 0), futures):
            out, stats = fut.result(timeout=30)
            assert torch.equal(out, flash_store.bundle(layer, ids))
            _check_stats(stats, ids, flash_store.row_bytes)


def test_concurrent_calls_keep_their_own_stats(flash_store):
    """A background read and calls from another thread on the same reader: each result carries the stats of
    its own call (distinct id counts make them tell apart), never those of a call that finished later."""
    with FlashReader(flash_store, threads=4, min_read=0, max_gap=-1) as r:

        def many_reads(n: int) -> list[tuple[int, ReadResult]]:
            return [(k, r.read(k % 2, torch.arange(0, 7 * k, 7))) for k in range(n, 0, -1)]

        background = [(k, r.read_async(k % 2, torch.arange(0, 5 * k, 5))) for k in range(1, 60)]
        with ThreadPoolExecutor(max_workers=2) as pool:
            results = [res for batch in pool.map(many_reads, [60, 45]) for res in batch]
        for k, future in background:
            out, stats = future.result(timeout=30)
            assert stats.n_reads == k and torch.equal(out, flash_store.bundle(k % 2, torch.arange(0, 5 * k, 5)))
        for k, (out, stats) in results:
            assert stats.n_reads == k and stats.bytes_requested == k * flash_store.row_bytes


def test_raw_file_contents(tmp_path):
    path = tmp_path / "f.bin"
    calibrate.make_test_file(path, 1 << 20, chunk=1 << 18)
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    with FlashReader.for_file(path, threads=3, min_read=0, max_gap=0) as r:
        for row_bytes, base in ((4096, 0), (1000, 77), (65536, 4096)):
            n_rows = (data.numel() - base) // row_bytes
            ids = torch.randint(0, n_rows, (25,))
            out = torch.empty(25 * row_bytes, dtype=torch.uint8)
            r.read_rows(base, row_bytes, n_rows, ids, out)
            want = torch.cat([data[base + i * row_bytes : base + (i + 1) * row_bytes] for i in ids.tolist()])
            assert torch.equal(out, want)


def _page_aligned(nbytes: int) -> torch.Tensor:
    buf = torch.zeros(nbytes + 4096, dtype=torch.uint8)
    skip = -buf.data_ptr() % 4096
    return buf[skip : skip + nbytes]


@pytest.mark.parametrize(
    "ids", [[3, 4, 5, 9], [9, 5, 4, 3], [4, 4, 5], list(range(64))], ids=["runs", "reversed", "repeated", "long_run"]
)
def test_reads_straight_into_aligned_out(tmp_path, ids):
    """Aligned rows into an aligned buffer skip the bounce buffer (in-order runs) or use it (other orders)."""
    path = tmp_path / "f.bin"
    calibrate.make_test_file(path, 1 << 20, chunk=1 << 18)
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).view(-1, 8192)
    with FlashReader.for_file(path, threads=2, min_read=0, max_gap=0) as r:
        out = _page_aligned(len(ids) * 8192)
        r.read_rows(0, 8192, data.shape[0], torch.tensor(ids), out)
        assert torch.equal(out.view(-1, 8192), data[ids])
        with open(path, "r+b") as f:
            f.truncate(40 * 8192)
        with pytest.raises(RuntimeError, match="end of file"):
            r.read_rows(0, 8192, data.shape[0], torch.tensor([50, 51]), _page_aligned(2 * 8192))


def test_calibrate_disk_and_profile(tmp_path, monkeypatch, flash_store, capsys):
    monkeypatch.setenv("FLASHLLM_DISK_PROFILE", str(tmp_path / "disk.json"))
    assert cli.main(["calibrate-disk", "--dir", str(tmp_path), "--size-mib", "32"]) == 0
    assert "latency" in capsys.readouterr().out
    profile = disk.load_disk_profile()
    assert profile.latency_s > 0 and profile.bandwidth_bps > 0
    assert [p.name for p in tmp_path.iterdir()] == ["disk.json"]  # the test file is gone
    assert FlashReader(flash_store, threads=1).max_gap == profile.max_gap_bytes(1)
    assert FlashReader(flash_store, threads=8).max_gap == profile.max_gap_bytes(8) <= profile.max_gap_bytes(1)
    (tmp_path / "disk.json").write_text("{broken")
    with pytest.warns(UserWarning, match="damaged disk profile"):
        assert FlashReader(flash_store, threads=1).max_gap == reader.DEFAULT_MAX_GAP


@pytest.mark.parametrize(
    "saved",
    [
        {"latency_s": float("nan"), "bandwidth_bps": 1e9, "path": "/"},
        {"latency_s": float("inf"), "bandwidth_bps": 1e9, "path": "/"},
        {"latency_s": -1e-4, "bandwidth_bps": 1e9, "path": "/"},
        {"latency_s": 1e-4, "bandwidth_bps": 0, "path": "/"},
        {"latency_s": 1e300, "bandwidth_bps": 1e300, "path": "/"},
        {"latency_s": 1e-4},
        [1e-4, 1e9],
        "{broken",
    ],
    ids=["nan", "inf", "negative", "no_bandwidth", "overflow", "missing_fields", "list", "not_json"],
)
def test_a_damaged_disk_profile_only_loses_the_tuning(tmp_path, monkeypatch, flash_store, saved):
    monkeypatch.setenv("FLASHLLM_DISK_PROFILE", str(tmp_path / "disk.json"))
    (tmp_path / "disk.json").write_text(saved if isinstance(saved, str) else json.dumps(saved))
    with pytest.warns(UserWarning, match="disk.json: ignoring a damaged disk profile"):
        assert disk.load_disk_profile() is None
    with pytest.warns(UserWarning, match="disk.json"), FlashReader(flash_store, threads=1) as r:
        assert r.max_gap == reader.DEFAULT_MAX_GAP


def test_calibrate_disk_never_writes_through_a_planted_symlink(tmp_path, monkeypatch):
    """The scratch file is created exclusively in a private folder of its own: a link planted at a predictable name
    in --dir is not followed (its target keeps its bytes), and the folder is removed after."""
    monkeypatch.setenv("FLASHLLM_DISK_PROFILE", str(tmp_path / "profile" / "disk.json"))
    victim = tmp_path / "victim"
    victim.write_text("precious")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / f".flashllm-calibrate-{os.getpid()}.bin").symlink_to(victim)
    seen = []
    real = calibrate.make_test_file

    def make_test_file(path, size):
        seen.append((os.stat(os.path.dirname(path)).st_mode & 0o777, os.path.dirname(path)))
        real(path, size)
        seen.append(os.stat(path).st_mode & 0o777)

    monkeypatch.setattr(calibrate, "make_test_file", make_test_file)
    calibrate.calibrate_disk(scratch, size=4 << 20)
    assert victim.read_text() == "precious"
    (private_mode, private_dir), file_mode = seen
    assert private_mode == 0o700 and file_mode == 0o600 and os.path.dirname(private_dir) == str(scratch)
    assert [p.name for p in scratch.iterdir()] == [f".flashllm-calibrate-{os.getpid()}.bin"]  # only the planted link


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_read_into_cuda(flash_store):
    with FlashReader(flash_store, threads=4) as r:
        ids = torch.randint(0, 700, (64,))
        out, stats = r.read(0, ids, torch.empty((64, flash_store.bundle_width), dtype=torch.float16, device="cuda"))
        assert torch.equal(out.cpu(), flash_store.bundle(0, ids))
        _check_stats(stats, ids, flash_store.row_bytes)


def test_coalescing_gap_shrinks_with_reads_in_flight():
    profile = disk.DiskProfile(latency_s=100e-6, bandwidth_bps=1e9, path="/x")
    assert profile.max_gap_bytes(1) == 100_000 // 4096 * 4096  # 100 us x 1 GB/s, whole 4 KiB blocks
    assert profile.max_gap_bytes(8) == 12_500 // 4096 * 4096
    assert profile.max_gap_bytes(32) == 0  # latency hidden by 31 other reads: merge adjacent neurons only


def test_read_rows_refuses_an_output_size_that_overflows(flash_store):
    with FlashReader.for_file(flash_store.bundles_path, threads=1) as r:
        with pytest.raises(RuntimeError, match="overflow"):  # 4 x 2^62 wraps to 0 == out.nbytes() in int64
            r.read_rows(0, 1 << 62, 1, torch.zeros(4, dtype=torch.int64), torch.empty(0, dtype=torch.uint8))


def test_store_shares_one_reader_until_closed(store_dir):
    fs = store.FlashStore(store_dir)
    first = shared_reader(fs)
    assert shared_reader(fs) is first
    fs.close()
    with pytest.raises(ValueError, match="closed"):
        first.read(0, [1])
    with fs:
        assert shared_reader(fs) is not first
        assert torch.equal(shared_reader(fs).read(0, [1]).data, fs.bundle(0, [1]))


def _statx_dio_align(path: str) -> tuple[int, int] | None:
    """(offset, memory) direct-I/O alignment as statx(2) reports it through libc, None where it reports none."""
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "statx"):
        return None
    buf = ctypes.create_string_buffer(256)  # struct statx
    at_fdcwd, statx_dioalign = -100, 0x2000
    if libc.statx(at_fdcwd, os.fsencode(path), 0, statx_dioalign, buf) != 0:
        return None
    (mask,) = struct.unpack_from("I", buf, 0)
    mem_align, offset_align = struct.unpack_from("II", buf, 152)  # stx_dio_mem_align, stx_dio_offset_align
    return (offset_align, mem_align) if mask & statx_dioalign and offset_align and mem_align else None


def test_direct_alignment_comes_from_statx(flash_store):
    with FlashReader(flash_store, threads=1) as r:
        assert r.direct
        for align in (r.dio_offset_align, r.dio_mem_align):
            assert align & (align - 1) == 0 and align >= 1
        assert r.dio_offset_align >= 512
        reported = _statx_dio_align(flash_store.bundles_path) if sys.platform == "linux" else None
        assert (r.dio_offset_align, r.dio_mem_align) == (reported or (4096, 4096))
    with FlashReader(flash_store, threads=1, direct=False) as r:
        assert (r.dio_offset_align, r.dio_mem_align) == (4096, 4096)  # buffered reads stay on page boundaries


@pytest.mark.parametrize("engine", ENGINES)
def test_rows_longer_than_one_request(tmp_path, engine):
    """Rows of 5 blocks and a bit at unaligned offsets with max_read of one block: the io_uring engine issues each
    row as several bounded requests (the bound that keeps its 32-bit length from wrapping), the data is whole."""
    path = tmp_path / "f.bin"
    calibrate.make_test_file(path, 1 << 20, chunk=1 << 18)
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    row_bytes, base = 5 * 4096 + 300, 777
    n_rows = (data.numel() - base) // row_bytes
    ids = torch.tensor([3, 0, 7, 8, 3, n_rows - 1])
    with FlashReader.for_file(path, threads=2, min_read=0, max_gap=0, max_read=4096, engine=engine) as r:
        out = torch.empty(ids.numel() * row_bytes, dtype=torch.uint8)
        stats = r.read_rows(base, row_bytes, n_rows, ids, out)
    want = torch.cat([data[base + i * row_bytes : base + (i + 1) * row_bytes] for i in ids.tolist()])
    assert torch.equal(out, want)
    assert stats.n_reads == 5 and stats.bytes_requested == 5 * row_bytes  # merging 7 and 8 would pass max_read


def test_for_file_refuses_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "data")
    refuses_without_blocking(lambda: FlashReader.for_file(tmp_path / "data", threads=1), tmp_path / "data")


@pytest.mark.parametrize("ids", [torch.tensor([0.7, 1.2]), [0.0, 1.0]], ids=["float_tensor", "float_list"])
def test_read_refuses_non_integer_ids(flash_store, ids):
    # int64 conversion would truncate them to neurons 0 and 1: a read of neurons nobody asked for.
    with FlashReader(flash_store, threads=1) as r, pytest.raises(ValueError, match="neuron ids must be integers"):
        r.read(0, ids)


def test_read_range_lands_the_widened_range_in_place(tmp_path):
    from flashllm_ext.io.buffers import aligned_buffer

    data = torch.randint(0, 256, (3 * 4096 + 1000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    path = tmp_path / "f.bin"
    path.write_bytes(data.numpy().tobytes())
    with FlashReader.for_file(path, max_read=4096) as r:
        unit = max(r.dio_offset_align, r.dio_mem_align)
        offset, nbytes = 700, 2 * 4096 + 5  # starts and ends inside blocks
        span = r.range_bytes(offset, nbytes)
        assert span % unit == 0 and span >= nbytes + offset % unit
        landing = aligned_buffer(span + unit)
        view, stats = r.read_range(offset, nbytes, landing)
        assert (
            torch.equal(view, data[offset : offset + nbytes]) and view.data_ptr() == landing.data_ptr() + offset % unit
        )
        assert stats.bytes_requested == nbytes and stats.bytes_read == span and stats.n_reads >= span // 4096
        assert torch.equal(r.range_view(offset, nbytes, landing)[0], view)
        with pytest.raises(ValueError, match="boundary"):
            r.read_range(offset, nbytes, landing[1:])
        with pytest.raises(ValueError, match="hold"):
            r.read_range(offset, nbytes, landing[: span - unit])
        with pytest.raises(ValueError, match="uint8"):
            r.read_range(offset, nbytes, landing.view(torch.int16))
        if data.numel() % unit:  # the file's last block is partial: a range widened past the end is refused
            with pytest.raises(ValueError, match="end of"):
                r.read_range(data.numel() - 10, 10, landing)
