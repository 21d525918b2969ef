"""Endor on the flash path: an Endor store's neuron rows read through FlashReader (coalesced,
decompressed into `out`), NeuronCache / FlashFFN / the engine over it, its format errors, the streaming convert, and
how a read reaches a CUDA destination (select_read_path; kvikio's staging logic with a stand-in CuFile)."""

import os
import sys
import types
import weakref

import pytest
import torch

import flashllm_ext
from flashllm_ext import FormatError, endor
from flashllm_ext.flash import reader, store
from flashllm_ext.flash.cache import NeuronCache
from flashllm_ext.flash.convert import bundle_layer, convert
from flashllm_ext.flash.stack import ffn_stack
from flashllm_ext.flash.reader import FlashReader, has_io_uring, select_read_path
from tests.helpers.models import tiny_model

ENGINES = ["threads"] + (["io_uring"] if has_io_uring() else [])
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _pruned_llama(n_neurons: int = 300, n_layers: int = 2, sparsity: float = 0.5) -> torch.nn.Module:
    model = tiny_model(
        "llama", intermediate_size=n_neurons, num_hidden_layers=n_layers, vocab_size=96, max_position_embeddings=128
    )
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.mlp.up_proj, layer.mlp.gate_proj, layer.mlp.down_proj):
                proj.weight.copy_(endor.prune(proj.weight, sparsity))
    return model


def _expected(model, layer: int, dtype: torch.dtype) -> torch.Tensor:
    """The bundles of the pruned weights, straight from the model: what every read must return."""
    mlp = model.model.layers[layer].mlp
    return bundle_layer(mlp.up_proj.weight.to(dtype), mlp.down_proj.weight.to(dtype), mlp.gate_proj.weight.to(dtype))


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    """(model, {dtype name: Endor store path}, dense fp32 store path) of one pruned checkpoint."""
    model = _pruned_llama()
    root = tmp_path_factory.mktemp("endor-store")
    model.save_pretrained(root / "ckpt")
    stores = {
        name: convert(root / "ckpt", root / f"endor-{name}", dtype=name, endor=True, progress=False) for name in DTYPES
    }
    return model, stores, convert(root / "ckpt", root / "dense-fp32", dtype="fp32", progress=False)


def _id_sets(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "sorted": torch.randperm(n, generator=g)[:60].sort().values,
        "unsorted": torch.randperm(n, generator=g)[:60],
        "repeated": torch.randint(0, n, (150,), generator=g),
        "empty": torch.empty(0, dtype=torch.int64),
        "all": torch.arange(n),
        "ends": torch.tensor([n - 1, 0, n - 1]),
        "run": torch.arange(40, 120),
    }


def _assert_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("coalescing", [(0, -1), (32 << 10, 64 << 10)], ids=["one_read_per_neuron", "coalesced"])
def test_reader_returns_the_pruned_rows(pruned, dtype, engine, coalescing):
    model, stores, _ = pruned
    fs = store.FlashStore(stores[dtype])
    assert fs.endor
    min_read, max_gap = coalescing
    with FlashReader(fs, threads=3, engine=engine, min_read=min_read, max_gap=max_gap) as r:
        for layer in range(fs.n_layers):
            want = _expected(model, layer, DTYPES[dtype])
            loc = fs.endor_location(layer)
            for name, ids in _id_sets(fs.n_neurons).items():
                out, stats = r.read(layer, ids)
                _assert_bitwise(out, want[ids])
                unique = torch.unique(ids)
                assert stats.bytes_requested == int((loc.starts[unique + 1] - loc.starts[unique]).sum()), name
                assert stats.path == "host" and stats.bytes_read >= stats.bytes_requested
                if max_gap < 0:
                    assert stats.n_reads == unique.numel(), name
                elif name in ("run", "all"):
                    assert stats.n_reads < unique.numel() / 4, name  # adjacent neurons merged


def test_endor_rows_move_about_half_the_bytes(pruned):
    """At 50% sparsity a neuron's compressed row is about half its dense bundle plus the bitmap: ~53% in fp32
    (bitmap 1/32), ~56% in fp16 / bf16 (bitmap 1/16)."""
    _, stores, dense_path = pruned
    ids = torch.arange(0, 300, 2)
    with FlashReader(store.FlashStore(stores["fp32"]), max_gap=-1, min_read=0) as r:
        endor_bytes = r.read(0, ids).stats.bytes_requested
    with FlashReader(store.FlashStore(dense_path), max_gap=-1, min_read=0) as r:
        dense_bytes = r.read(0, ids).stats.bytes_requested
    assert 0.5 < endor_bytes / dense_bytes < 0.56  # fp32: 1/32 bitmap + 1/2 values


def _planned_runs(r: FlashReader, fs: store.FlashStore, layer: int, ids: torch.Tensor) -> tuple[list, int]:
    """The neuron runs [first, end) of the reads the reader plans for `ids`, and their bytes (before alignment)."""
    plan = r.plan_layer(layer, torch.unique(ids))
    if fs.endor:
        loc = fs.endor_location(layer)
        bounds = torch.searchsorted(loc.starts, torch.stack([plan[:, 0], plan.sum(1)], 1) - loc.offset)
    else:
        loc = fs.layer_location(layer)
        bounds = torch.stack([plan[:, 0], plan.sum(1)], 1).sub(loc.offset).div(loc.row_bytes, rounding_mode="floor")
    return bounds.tolist(), int(plan[:, 1].sum())


@pytest.mark.parametrize(
    "rule",
    [
        (0, -1, 1 << 20),
        (0, 0, 1 << 20),
        (0, 7, 1 << 20),
        (12, 0, 1 << 20),
        (32 << 10, 64 << 10, 1 << 20),
        (0, 1 << 30, 8192),
    ],
    ids=["none", "adjacent", "gap7rows", "min_read12rows", "default", "max_read"],
)
def test_coalescing_counts_neurons_not_bytes(pruned, rule):
    """The gap rule counts skipped neurons (a row counts as its dense bundle): for one active set the Endor store
    merges exactly the dense store's neuron runs, each read shorter, so it reads fewer bytes. Counting the Endor
    file's own bytes would read through more unrequested neurons (its rows are ~0.55x as long)."""
    _, stores, dense_path = pruned
    endor_fs, dense_fs = store.FlashStore(stores["fp32"]), store.FlashStore(dense_path)
    min_read, max_gap, max_read = rule
    row = dense_fs.row_bytes
    if rule[:2] in ((0, 7), (12, 0)):  # given in rows: in bytes of the dense row
        min_read, max_gap = min_read * row, max_gap * row
    g = torch.Generator().manual_seed(5)
    sets = [torch.randperm(300, generator=g)[:k] for k in (10, 40, 120, 240)] + [
        torch.arange(40, 120),
        torch.arange(300),
    ]
    options = dict(threads=2, min_read=min_read, max_gap=max_gap, max_read=max_read)
    with FlashReader(endor_fs, **options) as endor_reader, FlashReader(dense_fs, **options) as dense_reader:
        for layer in range(dense_fs.n_layers):
            for ids in sets:
                endor_runs, endor_bytes = _planned_runs(endor_reader, endor_fs, layer, ids)
                dense_runs, dense_bytes = _planned_runs(dense_reader, dense_fs, layer, ids)
                assert endor_runs == dense_runs
                assert 0.5 * dense_bytes < endor_bytes < 0.6 * dense_bytes
                if rule == (32 << 10, 64 << 10, 1 << 20):  # long reads: the 4 KiB alignment does not dominate
                    endor_read = endor_reader.read(layer, ids).stats
                    dense_read = dense_reader.read(layer, ids).stats
                    assert endor_read.n_reads == dense_read.n_reads
                    assert endor_read.bytes_read <= dense_read.bytes_read


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("limit", [None, 0, 20_000], ids=["unlimited", "one_read_at_a_time", "limit"])
def test_bounce_buffers_stay_within_their_bound(pruned, engine, limit):
    """The native bounce buffers (kept between calls) never hold more than bounce_bound(): one read's buffer per
    thread without a limit, max(limit, one read's buffer) with one (limit 0: the reads take turns)."""
    _, stores, dense_path = pruned
    for path in (stores["fp16"], dense_path):
        fs = store.FlashStore(path)
        with FlashReader(
            fs, threads=4, engine=engine, min_read=0, max_gap=1 << 20, max_read=16384, bounce_limit=limit
        ) as r:
            assert r.bounce_bytes() == 0
            held = []
            for layer in range(fs.n_layers):
                for ids in _id_sets(fs.n_neurons).values():
                    r.read(layer, ids)
                    held.append(r.bounce_bytes())
            assert 0 < max(held) <= r.bounce_bound(), path


@pytest.mark.parametrize("layout", ["per-layer", "shared"])
def test_ffn_stack_charges_the_reader_buffers(pruned, layout):
    """Under a budget the engine limits the reader's bounce buffers (and an Endor store's staging) to a share of the
    FFN budget (a larger one beside a shared cache) and charges them to it: ffn_bytes = the modules (+ the shared
    cache) + FlashReader.buffer_bound()."""
    from flashllm_ext.flash.stack import READER_BUFFER_SHARE, SHARED_CACHE_READER_SHARE, store_ffn_bytes

    model, stores, dense_path = pruned
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    for path in (stores["fp32"], dense_path):
        fs = store.FlashStore(path)
        budget = store_ffn_bytes(fs) // 2
        runtime = ffn_stack(fs, "exact", budget, cache_layout=layout)
        shared = layout == "shared"
        reader = runtime.reader
        share = budget // (SHARED_CACHE_READER_SHARE if shared else READER_BUFFER_SHARE)
        assert reader.buffer_bound() == reader.bounce_bound() + reader.staging_bound()
        assert (reader.staging_bound() > 0) == fs.endor
        assert reader.bounce_limit + (reader.staging_bound() if fs.endor else 0) <= share
        assert runtime.ffn_bytes == sum(m.nbytes for m in runtime.modules) + reader.buffer_bound() + (
            runtime.modules[0].cache.nbytes if shared else 0
        )
        assert runtime.accounted_bytes <= budget
        with torch.no_grad():
            for i, layer in enumerate(model.model.layers):
                torch.testing.assert_close(runtime.modules[i](x), layer.mlp(x), rtol=1e-5, atol=1e-5)
        # No lower bound: a read that is aligned in the file and lands on an aligned cache row skips the bounce
        # buffers, and whether the allocator hands out such rows varies (ASan's does; test_bounce_buffers_stay_
        # within_their_bound covers the buffers in use).
        assert reader.bounce_bytes() <= reader.bounce_bound()
        runtime.close()
    assert ffn_stack(store.FlashStore(dense_path), "exact", None).reader.bounce_limit is None  # no budget


def test_small_staging_reads_in_pieces(pruned):
    """staging_bytes bounds the compressed bytes staged at once: a read is split into pieces, same result."""
    model, stores, _ = pruned
    fs = store.FlashStore(stores["fp16"])
    want = _expected(model, 1, torch.float16)
    ids = torch.randint(0, fs.n_neurons, (200,), generator=torch.Generator().manual_seed(1))
    with FlashReader(fs, threads=2, staging_bytes=1000) as r:
        out, stats = r.read(1, ids)
        _assert_bitwise(out, want[ids])
        assert stats.n_reads > 20 and stats.decompress_s > 0
        row = (fs.bundle_width + 7) // 8 + fs.row_bytes
        assert r.staging_bound() == 1000 + row


def test_read_into_a_given_out_and_async(pruned):
    model, stores, _ = pruned
    fs = store.FlashStore(stores["bf16"])
    want = _expected(model, 0, torch.bfloat16)
    ids = torch.tensor([5, 6, 7, 200, 5])
    out = torch.full((5, fs.bundle_width), 7.0, dtype=torch.bfloat16)
    with FlashReader(fs) as r:
        assert r.read(0, ids, out).data is out
        _assert_bitwise(out, want[ids])
        got, _ = r.read_async(0, ids.flip(0)).result()
        _assert_bitwise(got, want[ids.flip(0)])
        with pytest.raises(ValueError, match=r"\[0, 300\)"):
            r.read(0, torch.tensor([300]))


def test_store_bundle_reads_endor_rows(pruned):
    model, stores, _ = pruned
    fs = store.FlashStore(stores["fp16"])
    ids = torch.tensor([7, 3, 7, 0, 299])
    _assert_bitwise(fs.bundle(1, ids), _expected(model, 1, torch.float16)[ids])
    with pytest.raises(ValueError, match="endor_location"):
        fs.layer_location(0)


# ---- format errors ------------------------------------------------------------------------------------------------


def _copy_store(src, dst):
    dst.mkdir()
    for name in (store.BUNDLES_FILE, store.RESIDENT_FILE):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def _patch_bytes(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_truncated_store_raises_format_error(pruned, tmp_path):
    _, stores, _ = pruned
    path = _copy_store(stores["fp16"], tmp_path / "s")
    bundles = path / store.BUNDLES_FILE
    os.truncate(bundles, bundles.stat().st_size - 100)
    with pytest.raises(FormatError, match=r"bundles\.safetensors.*data_offsets"):
        store.FlashStore(path)


def test_inconsistent_row_offsets_raise_format_error(pruned, tmp_path):
    _, stores, _ = pruned
    path = _copy_store(stores["fp16"], tmp_path / "s")
    fs = store.FlashStore(path)
    entry = fs._entries[f"{store.layer_tensor_name(1)}.row_offsets"]
    _patch_bytes(path / store.BUNDLES_FILE, entry.begin + 8 * 10, (10**6).to_bytes(8, "little"))
    fs = store.FlashStore(path)
    with FlashReader(fs) as r:
        with pytest.raises(FormatError, match=r"bundles\.safetensors.*layers\.1\.bundles\.row_offsets"):
            r.read(1, torch.tensor([3]))
    with FlashReader(fs) as r:  # the other layer is intact
        r.read(0, torch.tensor([3]))


def test_corrupt_bitmap_raises_format_error(pruned, tmp_path):
    """A bitmap whose popcount disagrees with the row's value count: the decompression check names the field."""
    _, stores, _ = pruned
    path = _copy_store(stores["fp16"], tmp_path / "s")
    fs = store.FlashStore(path)
    loc = fs.endor_location(0)
    row = 17
    first = loc.offset + int(loc.starts[row])
    with open(path / store.BUNDLES_FILE, "rb") as f:
        f.seek(first)
        byte = f.read(1)[0]
    _patch_bytes(path / store.BUNDLES_FILE, first, bytes([byte ^ 1]))
    fs = store.FlashStore(path)
    with FlashReader(fs) as r:
        with pytest.raises(FormatError, match=r"bundles\.safetensors.*layers\.0\.bundles\.rows.*17"):
            r.read(0, torch.tensor([16, 17, 18]))
        r.read(0, torch.tensor([16, 18]))  # rows around it are intact
    with pytest.raises(FormatError, match=r"layers\.0\.bundles\.rows"):
        fs.bundle(0, torch.tensor([17]))


def test_older_endor_layout_is_refused(tmp_path):
    """Stores of the separate values/bitmap layout are refused naming the field, not misread."""
    from flashllm_ext.io.safetensors import AlignedWriter, TensorSpec

    model = _pruned_llama(n_neurons=40)
    model.save_pretrained(tmp_path / "ckpt")
    path = convert(tmp_path / "ckpt", tmp_path / "s", endor=True, progress=False)
    header = store.FlashStore(path)
    meta = dict(flashllm_ext.io.safetensors.read_header(header.bundles_path).metadata)
    specs = [TensorSpec(f"{store.layer_tensor_name(0)}.values", "F16", (4,))]
    with AlignedWriter(path / store.BUNDLES_FILE, specs, meta) as w:
        w.write(specs[0].name, torch.ones(4, dtype=torch.float16))
    with pytest.raises(FormatError, match=r"__metadata__\.endor.*older layout"):
        store.FlashStore(path)


# ---- convert streams ----------------------------------------------------------------------------------------------


def test_convert_endor_holds_at_most_one_layer(tmp_path, monkeypatch):
    """convert(endor=True) counts non-zeros first, then compresses and writes one layer at a time: the compressed
    bytes alive at once (EndorTensors and packed rows) never exceed those of the largest single layer."""
    model = _pruned_llama(n_neurons=200, n_layers=4)  # 4 layers: holding a second one would show
    model.save_pretrained(tmp_path / "ckpt")
    alive: dict[int, int] = {}  # id -> bytes of the compressed forms still alive
    peak, per_layer = [0], []
    real_compress, real_pack = endor.compress, endor.pack_rows

    def track(t, nbytes):
        alive[id(t)] = nbytes
        weakref.finalize(t, alive.pop, id(t), None)
        peak[0] = max(peak[0], sum(alive.values()))

    def compress(w):
        t = real_compress(w)
        track(t, t.nbytes)
        return t

    def pack_rows(t):
        blob = real_pack(t)
        per_layer.append(t.nbytes + blob.nbytes)
        track(blob, blob.nbytes)
        return blob

    monkeypatch.setattr(endor, "compress", compress)
    monkeypatch.setattr(endor, "pack_rows", pack_rows)
    fs = store.FlashStore(convert(tmp_path / "ckpt", tmp_path / "s", endor=True, progress=False))
    assert len(per_layer) == fs.n_layers == 4
    assert peak[0] <= max(per_layer)
    for layer in range(fs.n_layers):
        _assert_bitwise(fs.bundle(layer, torch.arange(fs.n_neurons)), _expected(model, layer, torch.float16))


# ---- the cache, the FFN and the engine ----------------------------------------------------------------------------


def test_neuron_cache_over_endor_equals_the_dense_cache(pruned):
    model, stores, dense_path = pruned
    endor_store, dense_store = store.FlashStore(stores["fp32"]), store.FlashStore(dense_path)
    caches = [NeuronCache(s, 1, capacity=90, window=2) for s in (endor_store, dense_store)]
    g = torch.Generator().manual_seed(9)
    endor_bytes = dense_bytes = endor_requested = dense_requested = 0
    for _ in range(12):
        ids = torch.randint(0, 300, (40,), generator=g)
        a, b = (c.step(ids) for c in caches)
        assert (a.inserted, a.evicted, a.num_used) == (b.inserted, b.evicted, b.num_used)
        endor_bytes, dense_bytes = endor_bytes + a.bytes_read, dense_bytes + b.bytes_read
        endor_requested, dense_requested = endor_requested + a.bytes_requested, dense_requested + b.bytes_requested
        assert b.bytes_requested == b.inserted * dense_store.row_bytes
        assert torch.equal(caches[0].pointer, caches[1].pointer)
        n = caches[0].num_used
        _assert_bitwise(caches[0].matrix[:n], caches[1].matrix[:n])
    assert endor_bytes < dense_bytes
    assert 0.5 < endor_requested / dense_requested < 0.56  # fp32 at 50%: half the values + a 1/32 bitmap


@pytest.mark.parametrize("mode", ["naive", "hybrid", "exact"])
@torch.no_grad()
def test_ffn_stack_over_endor_equals_the_pruned_ffn(pruned, mode):
    model, stores, dense_path = pruned
    fs = store.FlashStore(stores["fp32"])
    runtime = ffn_stack(fs, mode, None)
    x = torch.randn(3, fs.hidden_size, generator=torch.Generator().manual_seed(5))
    for i, layer in enumerate(model.model.layers):
        torch.testing.assert_close(runtime.modules[i](x), layer.mlp(x), rtol=1e-5, atol=1e-5)
    assert runtime.counters.bytes_read > 0
    runtime.close()


@pytest.mark.parametrize("mode", ["naive", "hybrid", "exact", "flash"])
@torch.no_grad()
def test_load_flash_on_endor_generates_the_tokens_of_transformers(pruned, mode):
    model, stores, dense_path = pruned
    from flashllm_ext.predictor import LowRankPredictor, PredictorSet

    prompt = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(2))
    want = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    predictors = None
    if mode == "flash":  # every neuron predicted active (threshold 0): the flash path with the dense answer
        torch.manual_seed(0)
        predictors = PredictorSet([LowRankPredictor(64, 300, 4) for _ in range(2)], torch.zeros(2))
        predictors.prob_thresholds.fill_(-1.0)
    flash = flashllm_ext.load_flash(
        stores["fp32"],
        dram_budget="85%",
        mode=mode,
        predictors=predictors,
        reader_options={"max_gap": 0, "min_read": 0},
    )
    assert (flash.flash.reader.max_gap, flash.flash.reader.min_read) == (0, 0)
    got = flash.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert torch.equal(got, want)
    stats = flash.flash.stats()
    assert stats["accounted_bytes"] <= stats["budget_bytes"] and stats["bytes_read"] > 0
    flash.flash.close()


# ---- SSD -> GPU: the path selection and kvikio's staging ------------------------------------------------------------


def test_select_read_path(monkeypatch):
    assert select_read_path("cpu") == "host"
    monkeypatch.setattr(reader, "kvikio_available", lambda: True)
    assert select_read_path(torch.device("cuda", 0)) == "kvikio"
    monkeypatch.setattr(reader, "kvikio_available", lambda: False)
    assert select_read_path("cuda") == "pinned"
    with pytest.raises(ValueError, match="CPU or CUDA"):
        select_read_path("meta")


def test_kvikio_available_follows_the_import(monkeypatch):
    monkeypatch.setitem(sys.modules, "kvikio", None)  # an import of kvikio now raises ImportError
    assert not reader.kvikio_available()
    monkeypatch.setitem(sys.modules, "kvikio", types.ModuleType("kvikio"))
    assert reader.kvikio_available()


def test_a_broken_kvikio_install_counts_as_absent(monkeypatch):
    # An install whose import fails for a missing libcufile or a CUDA mismatch: the pinned path serves instead.
    monkeypatch.delitem(sys.modules, "kvikio", raising=False)

    def broken(name, *args, **kwargs):
        if name == "kvikio":
            raise OSError("libcufile.so.0: cannot open shared object file")
        return real_import(name, *args, **kwargs)

    real_import = reader.importlib.import_module
    monkeypatch.setattr(reader.importlib, "import_module", broken)
    assert not reader.kvikio_available()
    assert select_read_path(torch.device("cuda", 0)) == "pinned"


def test_host_bounce_bytes_follow_the_read_path(monkeypatch):
    """What reads into GPU memory hold in pinned host memory (charged to an offload's host budget)."""
    layer = 403 << 20
    assert reader.host_bounce_bytes("host", layer, 32) == 0
    assert reader.host_bounce_bytes("pinned", layer, 32) == 512 << 20  # torch's caching host allocator rounds up
    assert reader.host_bounce_bytes("pinned", 0, 32) == 0  # nothing read from SSD
    defaults = types.SimpleNamespace(is_compat_mode_preferred=lambda: True)
    module = types.ModuleType("kvikio")
    module.defaults = defaults
    monkeypatch.setitem(sys.modules, "kvikio", module)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)
    assert reader.host_bounce_bytes("kvikio", layer, 32) == 32 * reader.KVIKIO_BOUNCE_BYTES  # a buffer per thread
    defaults.is_compat_mode_preferred = lambda: False  # GPUDirect Storage: no host bounce buffers
    assert reader.host_bounce_bytes("kvikio", layer, 32) == 0
    with pytest.raises(ValueError, match="read_path must be one of"):
        reader.host_bounce_bytes("gds", layer, 32)


class _RecordingKvikioDefaults:
    """kvikio.defaults' set(key, value), recording; `known` is the settings this kvikio version has."""

    def __init__(self, known):
        self.known, self.settings = known, {}

    def set(self, key, value):
        if key not in self.known:
            raise KeyError(key)
        self.settings[key] = value


def test_configure_kvikio_bounds_its_bounce_buffers_and_reads_direct():
    defaults = _RecordingKvikioDefaults({"num_threads", "bounce_buffer_size", "auto_direct_io_read"})
    reader.configure_kvikio(defaults, 16)
    assert defaults.settings == {
        "num_threads": 16,
        "bounce_buffer_size": reader.KVIKIO_BOUNCE_BYTES,
        "auto_direct_io_read": True,
    }
    older = _RecordingKvikioDefaults({"num_threads", "bounce_buffer_size"})  # before auto_direct_io_read
    reader.configure_kvikio(older, 16)
    assert older.settings == {"num_threads": 16, "bounce_buffer_size": reader.KVIKIO_BOUNCE_BYTES}
    oldest = types.SimpleNamespace(threads=[])  # before kvikio 25.02: no set()
    oldest.num_threads_reset = oldest.threads.append
    reader.configure_kvikio(oldest, 16)
    assert oldest.threads == [16]


class _PosixCuFile:
    """A stand-in for kvikio.CuFile (same pread signature and future) over plain pread into CPU tensors: it runs the
    reader's kvikio staging and gather logic where there is no GPU."""

    reads: list = []

    def __init__(self, path, flags="r"):
        self.fd = os.open(path, os.O_RDONLY)

    def pread(self, buf, size, file_offset):
        data = os.pread(self.fd, size, file_offset)
        buf[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        _PosixCuFile.reads.append((file_offset, size))
        return types.SimpleNamespace(get=lambda: len(data))

    def close(self):
        os.close(self.fd)


@pytest.fixture
def fake_kvikio(monkeypatch):
    module = types.ModuleType("kvikio")
    module.CuFile = _PosixCuFile
    module.defaults = types.SimpleNamespace(set=lambda key, value: None)
    monkeypatch.setitem(sys.modules, "kvikio", module)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", module.defaults)
    _PosixCuFile.reads = []
    return module


@pytest.mark.parametrize("endor_store", [True, False], ids=["endor", "dense"])
def test_kvikio_staging_logic_with_a_stand_in_cufile(pruned, fake_kvikio, endor_store):
    """The kvikio path's plan (the native coalescing), staging and gather, on the CPU through a stand-in CuFile."""
    model, stores, dense_path = pruned
    fs = store.FlashStore(stores["fp16"] if endor_store else dense_path)
    dtype = fs.dtype
    want = _expected(model, 1, dtype)
    with FlashReader(fs, min_read=0, max_gap=0) as r:
        for ids in _id_sets(fs.n_neurons).values():
            out = torch.empty((ids.numel(), fs.bundle_width), dtype=dtype)
            _PosixCuFile.reads = []
            if endor_store:
                stats = r._read_endor(1, ids, out, "kvikio")
            else:
                loc = fs.layer_location(1)
                stats = r._read_cufile(loc.offset, loc.row_bytes, loc.n_neurons, ids, out)
            _assert_bitwise(out, want[ids])
            assert stats.path == "kvikio" and stats.n_reads == len(_PosixCuFile.reads)
            host = r.read(1, ids).stats
            assert (stats.bytes_requested, stats.n_reads) == (host.bytes_requested, host.n_reads)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
@pytest.mark.parametrize("endor_store", [True, False], ids=["endor", "dense"])
def test_reads_into_cuda_tensors(pruned, endor_store):
    """The real SSD -> GPU paths: kvikio when installed (the [gpu] extra), else pinned buffers."""
    model, stores, dense_path = pruned
    fs = store.FlashStore(stores["fp16"] if endor_store else dense_path)
    want = _expected(model, 0, fs.dtype)
    ids = torch.tensor([3, 4, 5, 200, 3, 299])
    with FlashReader(fs) as r:
        out = torch.empty((ids.numel(), fs.bundle_width), dtype=fs.dtype, device="cuda")
        stats = r.read(0, ids, out).stats
        assert stats.path == ("kvikio" if reader.kvikio_available() else "pinned")
        _assert_bitwise(out.cpu(), want[ids])


@pytest.mark.slow
@torch.no_grad()
def test_default_model_wanda_pruned_endor_exact_mode(default_model, tmp_path):
    """The real model, Wanda-50%-pruned: load_flash in exact mode over its Endor store generates the greedy tokens
    of transformers running the same pruned weights."""
    from transformers import AutoModelForCausalLM

    from flashllm_ext.demos.endor import wanda_prune_ffn
    from flashllm_ext.hub import corpus_token_ids, load_hf_model

    gguf, model, tokenizer = default_model
    pruned_weights = wanda_prune_ffn(model, corpus_token_ids(tokenizer, "calibration", 256), 0.5, progress=False)
    pruned, _ = load_hf_model(gguf, state_dict=pruned_weights)
    config = pruned.config
    config.__dict__.pop("quantization_config", None)  # transformers will not save a model loaded from GGUF as is
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(pruned.state_dict())
    plain.save_pretrained(tmp_path / "ckpt")
    del plain
    path = convert(tmp_path / "ckpt", tmp_path / "store", dtype="fp32", endor=True, progress=False)
    prompt = tokenizer("The capital of France is", return_tensors="pt").input_ids
    flash = flashllm_ext.load_flash(path, dram_budget="75%", mode="exact")
    want = pruned.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert torch.equal(flash.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False), want)
    stats = flash.flash.stats()
    assert stats["accounted_bytes"] <= stats["budget_bytes"]
    flash.flash.close()
