"""flashllm_ext.endor: compress/EndorTensor, safetensors save/load (fuzzed), compressed-tensors interop, pruning."""

import json
import os
import struct

import numpy as np
import pytest
import torch
from compressed_tensors.compressors import BitmaskTensor, bitmask_decompress
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from flashllm_ext import FormatError, endor
from tests.helpers.faults import refuses_without_blocking
from tests.helpers.kernel_cases import assert_bitwise_equal, make_weight

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]


@pytest.mark.parametrize("dtype", DTYPES)
def test_compress_layout_is_the_documented_one(dtype):
    w = make_weight((5, 19), dtype, 0.5)
    e = endor.compress(w)
    mask = w.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[w.element_size()]) != 0
    assert torch.equal(e.bitmap, torch.from_numpy(np.packbits(mask.numpy(), axis=-1, bitorder="little")))
    assert torch.equal(e.row_offsets, torch.tensor([0] + mask.sum(1).cumsum(0).tolist()))
    assert_bitwise_equal(e.values, w[mask])
    assert e.shape == (5, 19) and e.dtype == dtype
    assert e.nbytes == e.values.numel() * w.element_size() + e.bitmap.numel() + 8 * 6


def test_compressed_ratio_at_half_sparsity_fp16():
    w = make_weight((256, 4096), torch.float16, 0.5)
    e = endor.compress(w)
    assert abs(e.density - 0.5) < 0.01
    # values at 50% (0.5) + bitmap (1/16 = 0.0625) + row offsets (negligible): the paper's ~56%.
    assert 0.55 < e.nbytes / e.dense_nbytes < 0.565


def test_compress_rejects_bad_input():
    with pytest.raises(ValueError, match="2-D"):
        endor.compress(torch.zeros(3))
    with pytest.raises(ValueError, match="supports"):
        endor.compress(torch.zeros(3, 3, dtype=torch.float64))


def test_inconsistent_arrays_raise_format_error():
    e = endor.compress(make_weight((4, 10), torch.float16, 0.5))
    with pytest.raises(FormatError, match="bitmap"):
        endor.EndorTensor(e.values, e.bitmap[:, :1], e.row_offsets, (4, 10))
    with pytest.raises(FormatError, match="row_offsets"):
        endor.EndorTensor(e.values, e.bitmap, e.row_offsets[:-1], (4, 10))
    with pytest.raises(FormatError, match="set bits|end at"):
        endor.EndorTensor(e.values[:-1], e.bitmap, e.row_offsets - torch.tensor([0, 0, 0, 0, 1]), (4, 10))
    with pytest.raises(FormatError, match="values"):
        endor.EndorTensor(e.values.double(), e.bitmap, e.row_offsets, (4, 10))


def test_to_moves_every_array():
    e = endor.compress(make_weight((3, 9), torch.float32, 0.5)).to("meta")
    assert {e.values.device.type, e.bitmap.device.type, e.row_offsets.device.type} == {"meta"}


# ------------------------------------------------------------------------------------------ compressed-tensors
def _compressed_tensors_arrays(w):
    """The arrays compressed-tensors' sparse-bitmask compressor stores for `w`, keyed without the weight's name."""
    stored = BitmaskTensor.from_dense(w).dict(name_prefix="w")
    return {name.removeprefix("w."): t for name, t in stored.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_from_compressed_tensors(dtype):
    w = torch.where(torch.rand(11, 37) < 0.4, torch.randn(11, 37), 0.0).to(dtype)  # no -0.0: that library drops it
    arrays = _compressed_tensors_arrays(w)
    e = endor.from_compressed_tensors(arrays["compressed"], arrays["bitmask"], arrays["shape"], arrays["row_offsets"])
    assert torch.equal(e.decompress(), w)


def test_to_compressed_tensors_is_what_that_library_reads():
    w = torch.where(torch.rand(6, 21) < 0.5, torch.randn(6, 21), 0.0).half()
    out = endor.to_compressed_tensors(endor.compress(w))
    ref = _compressed_tensors_arrays(w)
    assert set(out) == set(ref)
    for k in ref:
        assert torch.equal(out[k], ref[k]), k
    assert torch.equal(bitmask_decompress(out["compressed"], out["bitmask"], w.shape), w)


# ------------------------------------------------------------------------------------------ save / load
def _saved(tmp_path):
    tensors = {
        "mlp.up": endor.compress(make_weight((8, 30), torch.float16, 0.5)),
        "mlp.down": endor.compress(make_weight((30, 8), torch.int8, 0.3)),
        "norm": torch.randn(30),
    }
    path = tmp_path / "w.safetensors"
    endor.save(path, tensors)
    return path, tensors


def test_save_load_round_trip(tmp_path):
    path, tensors = _saved(tmp_path)
    loaded = endor.load(path)
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        if isinstance(t, endor.EndorTensor):
            assert loaded[name].shape == t.shape
            assert_bitwise_equal(loaded[name].decompress(), t.decompress())
        else:
            assert torch.equal(loaded[name], t)
    with safe_open(str(path), "pt") as f:  # any safetensors reader opens it
        assert "mlp.up.values" in f.keys() and f.metadata()["format"] == "flashllm-endor"


def test_save_refuses_colliding_names(tmp_path):
    with pytest.raises(ValueError, match="collide"):
        endor.save(tmp_path / "x.safetensors", {"a": endor.compress(torch.ones(2, 2)), "a.values": torch.ones(1)})


def _rewrite_header(path, edit):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda h: h["__metadata__"].update(format="other"), "format"),
        (lambda h: h["__metadata__"].update(version="99"), "version"),
        (lambda h: h["__metadata__"].update({"endor.mlp.up": "{bad json"}), "endor.mlp.up"),
        (lambda h: h["__metadata__"].update({"endor.mlp.up": '{"shape": [8], "dtype": "float16"}'}), "shape"),
        (lambda h: h["__metadata__"].update({"endor.mlp.up": '{"shape": [8, 41], "dtype": "float16"}'}), "bitmap"),
        (lambda h: h["__metadata__"].update({"endor.mlp.up": '{"shape": [8, 30], "dtype": "float32"}'}), "values"),
        (lambda h: h.pop("mlp.up.bitmap"), "mlp.up.bitmap"),
        (lambda h: h["mlp.up.values"].update(dtype="F99"), "dtype"),
        (lambda h: h["mlp.up.values"].update(shape=[10**9]), "data_offsets"),
        (lambda h: h["mlp.up.values"].update(data_offsets=[0, 10**12]), "data_offsets"),
        (lambda h: h["norm"].update(data_offsets=[0, 120]), "data_offsets"),  # overlaps another tensor
    ],
)
def test_load_names_the_bad_field(tmp_path, edit, field):
    path, _ = _saved(tmp_path)
    _rewrite_header(path, edit)
    with pytest.raises(FormatError, match=field) as info:
        endor.load(path)
    assert str(path) in str(info.value)


def test_load_detects_corrupt_data(tmp_path):
    path, _ = _saved(tmp_path)
    e = endor.load(path)["mlp.up"]
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    begin = 8 + n + header["mlp.up.row_offsets"]["data_offsets"][0]
    raw[begin + 8 * 3 : begin + 8 * 4] = struct.pack("<q", int(e.row_offsets[3]) + 1)  # one offset corrupted
    path.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="row_offsets"):
        endor.load(path)


def test_load_missing_file():
    with pytest.raises(FormatError, match="cannot read"):
        endor.load("/nonexistent/w.safetensors")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_files_raise_format_error_or_load(tmp_path, data):
    path, _ = _saved(tmp_path)
    raw = bytearray(path.read_bytes())
    action = data.draw(st.sampled_from(["truncate", "garble", "header_size", "append"]))
    if action == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif action == "garble":
        for _ in range(data.draw(st.integers(1, 8))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    elif action == "header_size":
        raw[:8] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1)))
    else:
        raw += bytes(data.draw(st.binary(min_size=1, max_size=64)))
    fuzzed = tmp_path / "fuzzed.safetensors"
    fuzzed.write_bytes(bytes(raw))
    try:
        loaded = endor.load(fuzzed)
    except FormatError:
        return
    # A mutation may leave a valid file (e.g. a flipped bit inside a value): then it must decompress cleanly.
    for t in loaded.values():
        if isinstance(t, endor.EndorTensor):
            assert t.decompress().shape == t.shape


# ------------------------------------------------------------------------------------------ pruning
def test_magnitude_prune_keeps_largest_per_row():
    w = torch.randn(16, 64)
    p = endor.prune(w, 0.75)
    assert ((p != 0).sum(1) == 16).all()
    kept_min = torch.where(p != 0, w.abs(), torch.inf).min(1).values
    dropped_max = torch.where(p == 0, w.abs(), 0).max(1).values
    assert (kept_min >= dropped_max).all()
    assert torch.equal(p[p != 0], w[p != 0])


def test_wanda_uses_activation_norms():
    w = torch.ones(4, 8)
    x = torch.zeros(10, 8)
    x[:, :4] = 1.0  # only the first four inputs carry signal
    p = endor.prune(w, 0.5, method="wanda", activations=x)
    assert torch.equal(p != 0, torch.tensor([[True] * 4 + [False] * 4] * 4))
    assert torch.equal(endor.prune(w * torch.arange(1, 9), 0.5) != 0, torch.tensor([[False] * 4 + [True] * 4] * 4))


def test_two_four_structure():
    w = torch.randn(8, 32)
    p = endor.prune(w, method="magnitude", structure="2:4")
    assert ((p.view(8, -1, 4) != 0).sum(-1) == 2).all()
    with pytest.raises(ValueError, match="divisible"):
        endor.prune(torch.randn(2, 6), structure="2:4")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"method": "random"}, "method"),
        ({"sparsity": 1.0}, "sparsity"),
        ({"method": "wanda"}, "activations"),
        ({"structure": "4"}, "N:M"),
        ({"structure": "5:4"}, "N <= M"),
    ],
)
def test_prune_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        endor.prune(torch.randn(4, 8), **kwargs)


def test_load_refuses_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "w.safetensors")
    refuses_without_blocking(lambda: endor.load(tmp_path / "w.safetensors"), tmp_path / "w.safetensors")
