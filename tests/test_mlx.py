"""The MLX backend (flashllm_ext.mlx): on Linux its mlx-op fallback, against the torch reference, bitwise.

The Metal kernel it dispatches on Apple Silicon is metal/endor_decompress.metal, tested on this machine through
the SIMT emulation in tests/test_simt.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flashllm_ext._ops import endor_decompress_reference
from kernel_cases import BITS, DTYPES, SHAPES, bits_equal, corrupt, make_case, with_padding_bits

mx = pytest.importorskip("mlx.core", reason="mlx is not importable (install the [mlx] extra)")
fmlx = pytest.importorskip("flashllm_ext.mlx")

_MX_DTYPE = {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16, torch.int8: mx.int8,
             torch.uint8: mx.uint8, torch.int64: mx.int64, torch.int32: mx.int32}
_MX_BITS = {mx.float32: mx.uint32, mx.float16: mx.uint16, mx.bfloat16: mx.uint16, mx.int8: mx.uint8}


def to_mx(t: torch.Tensor) -> "mx.array":
    """Bit-exact torch -> mlx (through an integer view: numpy has no bfloat16)."""
    t = t.contiguous()
    if t.dtype in BITS:
        return mx.array(t.view(BITS[t.dtype]).numpy()).view(_MX_DTYPE[t.dtype])
    return mx.array(t.numpy())


def to_torch(a: "mx.array", dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.array(a.view(_MX_BITS[a.dtype]))).view(BITS[dtype]).view(dtype)


def decompress(values, bitmap, row_offsets, n_cols, rows=None) -> torch.Tensor:
    out = fmlx.endor_decompress(to_mx(values), to_mx(bitmap), to_mx(row_offsets), n_cols,
                                None if rows is None else to_mx(rows))
    return to_torch(out, values.dtype)


def test_runs_the_fallback_here():
    assert not fmlx.metal_available(), "this test file documents the Linux path"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + ((64, 1000),))
def test_matches_reference_bitwise(dtype, shape):
    case = make_case(shape, dtype, seed=shape[0] * 1000 + shape[1])
    args = (case.values, case.bitmap, case.row_offsets, case.n_cols)
    assert bits_equal(decompress(*args), case.dense)
    rows = torch.randint(0, case.n_rows, (2 * case.n_rows + 1,), generator=torch.Generator().manual_seed(3))
    assert bits_equal(decompress(*args, rows), endor_decompress_reference(*args, rows))


def test_edge_inputs():
    case = make_case((7, 13), torch.bfloat16, seed=4)
    args = (case.values, case.bitmap, case.row_offsets, case.n_cols)
    assert decompress(*args, torch.empty(0, dtype=torch.int64)).shape == (0, 13)
    for density in (0.0, 1.0):
        c = make_case((4, 40), torch.float16, seed=5, density=density)
        assert bits_equal(decompress(c.values, c.bitmap, c.row_offsets, 40), c.dense)
    padded = with_padding_bits(case)
    padded_args = (padded.values, padded.bitmap, padded.row_offsets, padded.n_cols)
    assert bits_equal(decompress(*padded_args), endor_decompress_reference(*padded_args))


@pytest.mark.parametrize("kind,message", [
    ("count", r"row 2: row_offsets says \d+ values but the bitmap has \d+ set bits"),
    ("non_monotone", r"row_offsets must be non-decreasing, but row_offsets\[3\]"),
    ("negative", r"row 0 starts at row_offsets\[0\] = -1"),
    ("short", r"values is too short: row 6 ends at"),
    ("row_high", r"rows\[1\] = 7 is outside \[0, 7\)"),
    ("row_negative", r"rows\[1\] = -1 is outside \[0, 7\)"),
])
def test_reports_bad_rows(kind, message):
    with pytest.raises(RuntimeError, match=message):
        decompress(*corrupt(kind))


def test_rejects_bad_arguments():
    case = make_case((7, 13), torch.float16, seed=6)
    v, b, o = case.values, case.bitmap, case.row_offsets
    bad = [
        ((v.view(torch.int16).int(), b, o, 13), "values must be"),
        ((v.reshape(1, -1), b, o, 13), "1-D"),
        ((v, b.int(), o, 13), "bitmap must be a 2-D uint8"),
        ((v, b, o, 20), "bytes per row"),
        ((v, b, o.int(), 13), "row_offsets must be int64"),
        ((v, b, o[:-1], 13), "length rows\\+1"),
        ((v, b, o, 13, torch.tensor([0, 1], dtype=torch.int32)), "rows must be a 1-D int64"),
    ]
    for args, message in bad:
        with pytest.raises(RuntimeError, match=message):
            decompress(*args)


def test_metal_kernel_source_is_found_and_accepted():
    # Running it needs Metal; building the kernel object checks the file is found and the call shape is valid.
    assert "simd_prefix_exclusive_sum" in fmlx.metal_source("endor_decompress.metal")
    assert fmlx._endor_kernel() is not None
