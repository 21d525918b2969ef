"""FlashStore: reads what convert wrote, and refuses stores whose headers lie (FormatError naming file and field)."""

import json
import os
import shutil
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashllm_ext import FormatError
from flashllm_ext.flash import store
from flashllm_ext.flash.convert import convert
from flashllm_ext.offload.store import LAYERS_FILE, LayerStore
from flashllm_ext.offload.convert import convert_offload
from flashllm_ext.io.checkpoint import open_checkpoint
from flashllm_ext.io.safetensors import AlignedWriter, TensorSpec, read_header
from tests.helpers.checkpoints import rewrite_header
from tests.helpers.faults import refuses_without_blocking
from tests.helpers.memory import mapped_ranges
from tests.helpers.models import tiny_model


@pytest.fixture(scope="module")
def llama_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    tiny_model("llama", num_hidden_layers=3).save_pretrained(root / "ckpt")
    return convert(root / "ckpt", root / "store", progress=False)


@pytest.fixture(scope="module")
def layer_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("layers")
    tiny_model("llama", num_hidden_layers=3).save_pretrained(root / "ckpt")
    return convert_offload(root / "ckpt", root / "store")


@pytest.fixture
def store_copy(llama_store, tmp_path):
    return shutil.copytree(llama_store, tmp_path / "copy")


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("magic", "not-a-store", "magic"),
        ("format_version", "99", "format_version"),
        ("dtype", "fp8", "dtype"),
        ("n_neurons", "abc", "n_neurons"),
        ("bundle_width", "65", "bundle_width"),
        ("alignment", "1000", "alignment"),
        ("n_layers", "4", "layers.3.bundles"),
        ("n_neurons", "161", r"layers\.0\.bundles\.shape"),
        ("config", "{", "config"),
        ("format_version", "1", "format_version"),  # stores written before ffn_roles
        ("ffn_roles", "{", "ffn_roles"),
        ("ffn_roles", "[]", "ffn_roles"),
        ("ffn_roles", '[{"up":"a"},{"up":"a"},{"up":"a"}]', r"ffn_roles\[0\]"),
    ],
)
def test_metadata_lies_raise_format_error(store_copy, field, value, match):
    bundles = store_copy / store.BUNDLES_FILE
    rewrite_header(bundles, lambda h: h["__metadata__"].__setitem__(field, value))
    with pytest.raises(FormatError, match=match) as info:
        store.FlashStore(store_copy)
    assert str(bundles) in str(info.value)


def test_resident_magic_checked(store_copy):
    resident = store_copy / store.RESIDENT_FILE
    rewrite_header(resident, lambda h: h["__metadata__"].__setitem__("magic", "x"))
    with pytest.raises(FormatError, match="resident.*magic"):
        store.FlashStore(store_copy)


def test_header_lies_about_sizes(store_copy):
    def shrink(h):
        h[store.layer_tensor_name(1)]["shape"][0] -= 1

    rewrite_header(store_copy / store.BUNDLES_FILE, shrink)
    with pytest.raises(FormatError, match="layers.1.bundles"):
        store.FlashStore(store_copy)


def test_misaligned_tensor(tmp_path, llama_store):
    # A store written with 64-byte alignment but claiming 4096: the loader must check offsets, not trust metadata.
    header = read_header(store.FlashStore(llama_store).bundles_path)
    d = tmp_path / "s"
    d.mkdir()
    (d / store.RESIDENT_FILE).write_bytes((llama_store / store.RESIDENT_FILE).read_bytes())
    entry = header.tensors[store.layer_tensor_name(0)]
    specs = [TensorSpec("small", "U8", (3,))] + [
        TensorSpec(store.layer_tensor_name(l), entry.dtype, entry.shape) for l in range(3)
    ]
    with AlignedWriter(d / store.BUNDLES_FILE, specs, header.metadata, alignment=64) as w:
        w.write("small", torch.zeros(3, dtype=torch.uint8))
        for l in range(3):
            w.write(store.layer_tensor_name(l), torch.zeros(entry.shape, dtype=torch.float16))
    with pytest.raises(FormatError, match="not a multiple"):
        store.FlashStore(d)


def test_truncated_store(store_copy):
    bundles = store_copy / store.BUNDLES_FILE
    size = bundles.stat().st_size
    with open(bundles, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(FormatError, match="data_offsets"):
        store.FlashStore(store_copy)


def test_truncated_behind_the_back_of_an_open_store(store_copy):
    fs = store.FlashStore(store_copy)
    with open(fs.bundles_path, "r+b") as f:
        f.truncate(fs.layer_location(2).offset + 10)
    with pytest.raises(FormatError, match="short read"):
        fs.bundle(2, [0, 5])
    assert fs.bundle(1, [0, 5]).shape == (2, fs.bundle_width)


def test_missing_file(store_copy):
    (store_copy / store.RESIDENT_FILE).unlink()
    with pytest.raises(FormatError, match="resident"):
        store.FlashStore(store_copy)


def test_bad_ids_and_layers(llama_store):
    fs = store.FlashStore(llama_store)
    with pytest.raises(ValueError, match="neuron ids"):
        fs.bundle(0, [fs.n_neurons])
    with pytest.raises(ValueError, match="neuron ids"):
        fs.bundle(0, [-1])
    with pytest.raises(ValueError, match="layer"):
        fs.bundle(3, [0])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_headers_raise_format_error_or_load(store_copy, data):
    bundles = store_copy / store.BUNDLES_FILE
    original = bundles.read_bytes()
    try:
        (size,) = struct.unpack("<Q", original[:8])
        if data.draw(st.booleans()):
            pos = data.draw(st.integers(0, 8 + size - 1))
            corrupted = bytearray(original)
            corrupted[pos] = data.draw(st.integers(0, 255))
        else:
            corrupted = original[: data.draw(st.integers(0, len(original) - 1))]
        bundles.write_bytes(bytes(corrupted))
        try:
            fs = store.FlashStore(store_copy)
        except FormatError:
            return
        fs.bundle(0, [0, fs.n_neurons - 1])  # what loads must be consistent enough to read
    finally:
        bundles.write_bytes(original)


@pytest.mark.parametrize(
    "role,name,match",
    [
        ("gate_bias", "model.layers.0.no_such.bias", "not a resident tensor"),
        ("up_bias", "model.norm.weight", r"shape \(160,\)"),  # [d], not [n_neurons]
        ("bias", "model.norm.weight", "needs exactly the weights"),
    ],
)
def test_ffn_roles_must_name_resident_tensors_of_the_right_shape(store_copy, role, name, match):
    def add_role(h):
        roles = json.loads(h["__metadata__"]["ffn_roles"])
        roles[0][role] = name
        h["__metadata__"]["ffn_roles"] = json.dumps(roles)
        h["__metadata__"]["config"] = "{}"  # room in the header for the longer roles

    rewrite_header(store_copy / store.BUNDLES_FILE, add_role)
    with pytest.raises(FormatError, match=match):
        store.FlashStore(store_copy)


def test_resident_header_is_read_once(llama_store, monkeypatch):
    import flashllm_ext.io.safetensors as safetensors_io

    read = []
    real = safetensors_io.read_header
    monkeypatch.setattr(safetensors_io, "read_header", lambda path: read.append(path) or real(path))
    fs = store.FlashStore(llama_store)  # its own header read is FlashStore's, not the resident file's
    names = fs.resident_names()
    assert all(torch.equal(fs.resident_tensor(n), fs.resident()[n]) for n in names[:3])
    assert [fs.layer_bias(layer, "down_bias") for layer in range(fs.n_layers)] == [None] * fs.n_layers
    assert read == [fs.resident_path]
    fs.close()  # forgets the header; the next read reads it again
    fs.resident_tensor(names[0])
    assert read == [fs.resident_path] * 2
    with pytest.raises(ValueError, match="role"):
        fs.layer_bias(0, "up")
    with pytest.raises(KeyError, match="no tensor"):
        fs.resident_tensor("model.nope.weight")


def test_resident_tensors_do_not_map_the_store(llama_store):
    """Resident tensors own their memory and the file is never mapped: a mapping keeps every page read charged to a
    memory cgroup beside the copies (a Llama-3-8B-shaped store's 1.35 GB twice at load), and a view of it could be
    evicted and read again from storage on every use. Their values are the file's."""
    import flashllm_ext
    from safetensors.torch import load_file

    model = flashllm_ext.load_flash(llama_store, None, mode="exact")
    fs = store.FlashStore(llama_store)
    tensors = {n: fs.resident_tensor(n) for n in fs.resident_names()}
    assert not mapped_ranges(fs.resident_path)  # read, not mapped, even before close()
    expected = load_file(fs.resident_path)
    assert tensors.keys() == expected.keys() and all(torch.equal(tensors[n], expected[n]) for n in tensors)
    assert len(list(model.parameters())) > 0
    model.flash.close()
    fs.close()


def test_resident_tensors_are_read_a_chunk_at_a_time_and_each_chunk_dropped(llama_store, monkeypatch):
    """A large resident tensor (a 7B model's 262 MB embedding) is read RESIDENT_READ_CHUNK bytes at a time, each
    chunk's page cache dropped before the next: a cgroup never holds more than a chunk of it as page cache beside the
    tensor being filled. Values equal the file's whatever the chunk."""
    from safetensors.torch import load_file

    from flashllm_ext.io import safetensors as st

    monkeypatch.setattr(st, "RESIDENT_READ_CHUNK", 4096)
    dropped, advise = [], os.posix_fadvise
    monkeypatch.setattr(st.os, "posix_fadvise", lambda fd, at, n, how: dropped.append(n) or advise(fd, at, n, how))
    fs = store.FlashStore(llama_store)
    expected = load_file(fs.resident_path)
    largest = max(expected, key=lambda n: expected[n].nbytes)
    assert expected[largest].nbytes > 4096
    assert torch.equal(fs.resident_tensor(largest), expected[largest])
    assert sum(dropped) == expected[largest].nbytes and max(dropped) <= 4096
    fs.close()


@pytest.mark.parametrize("name", [store.BUNDLES_FILE, store.RESIDENT_FILE])
def test_a_fifo_in_place_of_a_store_file_is_refused(store_copy, name):
    (store_copy / name).unlink()
    os.mkfifo(store_copy / name)
    refuses_without_blocking(lambda: store.FlashStore(store_copy), store_copy / name)


def test_a_fifo_in_place_of_a_layer_store_file_is_refused(layer_store, tmp_path):
    copy = shutil.copytree(layer_store, tmp_path / "copy")
    (copy / store.RESIDENT_FILE).unlink()
    os.mkfifo(copy / store.RESIDENT_FILE)
    refuses_without_blocking(lambda: LayerStore(copy), copy / store.RESIDENT_FILE)


@pytest.mark.parametrize(
    "ids",
    [torch.tensor([0.7, 1.2]), [0.0, 1.0], torch.tensor([True, False])],
    ids=["float_tensor", "float_list", "bool"],
)
def test_non_integer_neuron_ids_are_refused(llama_store, ids):
    fs = store.FlashStore(llama_store)
    with pytest.raises(ValueError, match="neuron ids must be integers"):
        fs.check_ids(ids)
    with pytest.raises(ValueError, match="neuron ids must be integers"):
        fs.bundle(0, ids)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda c: [c], r"config: must be a JSON object"),
        (lambda c: {**c, "vocab_size": 10**11}, r"config\.vocab_size: 100000000000 is the row count of no resident"),
        (lambda c: {**c, "vocab_size": 1e11}, r"config\.vocab_size: must be a positive integer"),
        (lambda c: {**c, "hidden_size": "64"}, r"config\.hidden_size: must be a positive integer"),
        (lambda c: {**c, "num_hidden_layers": 0}, r"config\.num_hidden_layers: must be a positive integer"),
    ],
    ids=["list", "vocab_10e11", "vocab_float", "hidden_str", "no_layers"],
)
@pytest.mark.parametrize("kind", ["flash", "layers"])
def test_model_config_lies_raise_format_error(store_copy, layer_store, tmp_path, kind, edit, match):
    # The model is built from the config: sizes the files do not back must fail here, not allocate there.
    root, file, load = (
        (store_copy, store.BUNDLES_FILE, store.FlashStore)
        if kind == "flash"
        else (shutil.copytree(layer_store, tmp_path / "layers"), LAYERS_FILE, LayerStore)
    )

    def rewrite(header):
        header["__metadata__"]["config"] = json.dumps(edit(json.loads(header["__metadata__"]["config"])))

    rewrite_header(root / file, rewrite)
    with pytest.raises(FormatError, match=match):
        load(root)


@pytest.fixture(scope="module")
def q4_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("q4")
    tiny_model("llama", num_hidden_layers=3).save_pretrained(root / "ckpt")
    return convert(root / "ckpt", root / "store", dtype="q4", progress=False)


def _set(**fields):
    return lambda h: h["__metadata__"].update(fields)


def _reshape_layer_1(h):
    n, row_bytes = h[store.layer_tensor_name(1)]["shape"]
    h[store.layer_tensor_name(1)]["shape"] = [2 * n, row_bytes // 2]  # the same bytes, other rows


@pytest.mark.parametrize(
    "edit,match",
    [
        (_set(bundle_format="q5_0+q8_0"), r"__metadata__\.bundle_format: 'q5_0\+q8_0'"),
        (_set(bundle_format="q4_0"), r"__metadata__\.bundle_format: 'q4_0'"),
        (lambda h: h["__metadata__"].pop("bundle_format"), r"__metadata__\.bundle_format: None"),
        (_set(endor="1"), r"__metadata__\.bundle_format: 'q4_0\+q8_0' with Endor compression"),
        (_set(bundle_format="float"), r"layers\.0\.bundles\.shape: U8\[160, 140\], expected F16\[160, 192\]"),
        (_set(bundle_format="q8_0+q8_0"), r"layers\.0\.bundles\.shape: U8\[160, 140\], expected U8\[160, 204\]"),
        (_reshape_layer_1, r"layers\.1\.bundles\.shape: U8\[320, 70\], expected U8\[160, 140\]"),
        (_set(format_version="9"), r"__metadata__\.format_version: unsupported version '9'"),
        (_set(tensor_sources="{"), r"__metadata__\.tensor_sources: not JSON"),
        (_set(tensor_sources='[{"up": "kept Q4_0 blocks"}]'), r"__metadata__\.tensor_sources: must map"),
    ],
    ids=[
        "unknown_format",
        "one_format",
        "no_format",
        "endor",
        "float_with_u8_rows",
        "q8_rows_of_q4_size",
        "rows_of_wrong_shape",
        "version_9",
        "sources_not_json",
        "sources_of_one_layer",
    ],
)
def test_quantized_store_lies_raise_format_error(q4_store, tmp_path, edit, match):
    copy = shutil.copytree(q4_store, tmp_path / "copy")
    bundles = copy / store.BUNDLES_FILE
    rewrite_header(bundles, edit)
    with pytest.raises(FormatError, match=match) as info:
        store.FlashStore(copy)
    assert str(bundles) in str(info.value)


def test_quantized_store_reads_uint8_rows_and_floats(q4_store):
    fs = store.FlashStore(q4_store)
    assert fs.quantized and fs.bundle_format.name == "q4_0+q8_0" and fs.dtype == torch.float16
    rows = fs.bundle(2, [7, 0, 7])
    assert rows.dtype == torch.uint8 and rows.shape == (3, fs.row_bytes) and torch.equal(rows[0], rows[2])
    assert fs.layer_location(2).row_bytes == fs.row_bytes == 140
    floats = fs.float_bundle(2, [7, 0])
    assert torch.equal(floats, fs.bundle_format.dequantize(rows[:2], fs.hidden_size, True).half())


def test_a_version_2_store_opens_as_float(store_copy, llama_store):
    """Stores written before quantized bundles (format version 2, no bundle_format) still open, as float stores."""

    def downgrade(h):
        h["__metadata__"]["format_version"] = "2"
        del h["__metadata__"]["bundle_format"]

    rewrite_header(store_copy / store.BUNDLES_FILE, downgrade)
    rewrite_header(store_copy / store.RESIDENT_FILE, _set(format_version="2"))
    old, new = store.FlashStore(store_copy), store.FlashStore(llama_store)
    assert old.bundle_format is None and not old.quantized and old.tensor_sources is None
    ids = [0, 5, old.n_neurons - 1]
    assert torch.equal(old.bundle(1, ids), new.bundle(1, ids)) and old.bundle(1, ids).dtype == torch.float16


def test_ffn_weights_are_the_checkpoints_matrices(llama_store):
    """ffn_weights(layer): each FFN matrix by its checkpoint name, oriented as the checkpoint holds it."""
    ckpt = open_checkpoint(os.path.join(os.path.dirname(llama_store), "ckpt"))
    with store.FlashStore(llama_store) as opened:
        for layer in range(opened.n_layers):
            weights = opened.ffn_weights(layer)
            assert sorted(weights) == sorted(opened.ffn_roles[layer].values())
            for name, w in weights.items():
                assert torch.equal(w, ckpt[name].to(opened.dtype)), name
