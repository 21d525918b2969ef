"""flashllm::endor_decompress: native CPU kernel (every ISA path) against the pure-torch reference and the
original weights, bitwise; opcheck; bad inputs. The CUDA and Metal bodies are tested in test_simt.py."""

import pytest
import torch

from flashllm_ext import _C, endor, ops
from flashllm_ext.ops import ENDOR_DTYPES, endor_decompress_reference
from flashllm_ext.ops.bits import BITS_VIEW

from conftest import cpu_isas, forced_isa_fixture

DTYPES = list(ENDOR_DTYPES)
SPECIAL_BITS = {  # -0.0, NaN with payload, +inf, -inf, smallest subnormal, largest subnormal
    torch.float32: [-(2**31), 0x7FC12345, 0x7F800000, -8388608, 1, 0x007FFFFF],
    torch.float16: [-(2**15), 0x7E01, 0x7C00, -1024, 1, 0x03FF],
    torch.bfloat16: [-(2**15), 0x7FC1, 0x7F80, -128, 1, 0x007F],
    torch.int8: [-128, 127, 1, -1],
}


isa = forced_isa_fixture(cpu_isas(paths=("scalar", "avx2", "avx512", "avx512vbmi2")))


def make_weight(shape, dtype, density=0.5, seed=0):
    """Random bit patterns (so every value is exercised, specials included), zeroed at random."""
    g = torch.Generator().manual_seed(seed)
    itype = BITS_VIEW[dtype]
    info = torch.iinfo(itype)
    bits = torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(itype)
    specials = torch.tensor(SPECIAL_BITS[dtype], dtype=torch.int64).to(itype)
    flat = bits.view(-1)
    n = min(flat.numel(), len(specials))
    flat[torch.randperm(flat.numel(), generator=g)[:n]] = specials[:n]
    bits[torch.rand(shape, generator=g) >= density] = 0
    return bits.view(dtype)


def assert_bitwise_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(BITS_VIEW[a.dtype]), b.view(BITS_VIEW[b.dtype]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (1, 100), (100, 1), (7, 13), (3, 64), (5, 65), (9, 257), (2, 1000)])
@pytest.mark.parametrize("density", [0.0, 0.03, 0.5, 1.0])
def test_native_matches_weights_and_reference(isa, dtype, shape, density):
    w = make_weight(shape, dtype, density, seed=hash((shape, density)) % 1000)
    e = endor.compress(w)
    got = ops.endor_decompress(e.values, e.bitmap, e.row_offsets, n_cols=shape[1])
    assert_bitwise_equal(got, w)
    assert_bitwise_equal(endor_decompress_reference(e.values, e.bitmap, e.row_offsets, shape[1]), w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_subset_any_order_with_repeats(isa, dtype):
    w = make_weight((37, 77), dtype, 0.4)
    e = endor.compress(w)
    rows = torch.tensor([36, 0, 5, 5, 17, 0, 36, 2])
    assert_bitwise_equal(e.decompress(rows), w[rows])
    assert e.decompress(torch.empty(0, dtype=torch.int64)).shape == (0, 77)


def test_rows_with_all_zero_and_all_nonzero(isa):
    w = make_weight((6, 45), torch.float16, 0.5)
    w[1] = 0
    w[3] = make_weight((1, 45), torch.float16, 1.0)[0].abs() + 1
    e = endor.compress(w)
    assert e.row_offsets[2] - e.row_offsets[1] == 0 and e.row_offsets[4] - e.row_offsets[3] == 45
    assert_bitwise_equal(e.decompress(), w)


def test_large_llama_ffn_shape():
    w = make_weight((4096, 11008), torch.float16, 0.5)
    e = endor.compress(w)
    out = torch.empty_like(w)
    assert e.decompress(out=out) is out
    assert_bitwise_equal(out, w)


def test_non_contiguous_inputs(isa):
    w = make_weight((20, 31), torch.bfloat16, 0.5)
    e = endor.compress(w.t().contiguous().t())  # non-contiguous weight
    assert_bitwise_equal(e.decompress(), w)
    spread = torch.zeros(2 * e.values.numel(), dtype=e.values.dtype)
    spread[::2] = e.values
    rows = torch.arange(40)[::2] // 2  # strided view
    got = ops.endor_decompress(spread[::2], e.bitmap, e.row_offsets, n_cols=31, rows=rows)
    assert_bitwise_equal(got, w[rows])


def test_out_variant_writes_into_buffer():
    w = make_weight((8, 24), torch.float32, 0.5)
    e = endor.compress(w)
    out = torch.full((8, 24), 7.0)
    assert torch.ops.flashllm.endor_decompress.out(e.values, e.bitmap, e.row_offsets, 24, None, out=out) is None
    assert_bitwise_equal(out, w)
    out.fill_(7.0)
    assert ops.endor_decompress(e.values, e.bitmap, e.row_offsets, n_cols=24, out=out) is out
    assert_bitwise_equal(out, w)


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8])
def test_opcheck(dtype):
    # Finite values: opcheck compares outputs with assert_close, for which NaN != NaN.
    w = (torch.randn(9, 21) * 20).to(dtype)
    w[torch.rand(9, 21) < 0.5] = 0
    e = endor.compress(w)
    args = (e.values, e.bitmap, e.row_offsets, 21)
    torch.library.opcheck(torch.ops.flashllm.endor_decompress.default, args)
    torch.library.opcheck(torch.ops.flashllm.endor_decompress.default, args + (torch.tensor([3, 1, 3]),))
    torch.library.opcheck(
        torch.ops.flashllm.endor_decompress.out, args + (None,), {"out": torch.empty(9, 21, dtype=dtype)}
    )


def test_meta_tensors_give_shapes():
    vals = torch.empty(10, device="meta", dtype=torch.float16)
    bm = torch.empty(4, 2, device="meta", dtype=torch.uint8)
    off = torch.empty(5, device="meta", dtype=torch.int64)
    assert ops.endor_decompress(vals, bm, off, n_cols=13).shape == (4, 13)
    assert ops.endor_decompress(
        vals, bm, off, n_cols=13, rows=torch.empty(7, device="meta", dtype=torch.int64)
    ).shape == (7, 13)


def test_fake_kernel_checks_metadata():
    # The fake kernel makes the metadata checks of the native ones, without data: meta tensors raise the same errors.
    vals = torch.empty(10, device="meta", dtype=torch.float16)
    bm = torch.empty(4, 2, device="meta", dtype=torch.uint8)
    off = torch.empty(5, device="meta", dtype=torch.int64)
    with pytest.raises(RuntimeError, match="bitmap has 2 bytes per row, n_cols=20 needs 3"):
        ops.endor_decompress(vals, bm, off, n_cols=20)
    with pytest.raises(RuntimeError, match="row_offsets must be int64 of length rows\\+1=5"):
        ops.endor_decompress(vals, bm, off[:4], n_cols=13)
    with pytest.raises(RuntimeError, match="rows must be a 1-D int64 tensor"):
        ops.endor_decompress(vals, bm, off, n_cols=13, rows=torch.empty(3, device="meta"))
    with pytest.raises(RuntimeError, match="out must be a contiguous"):
        ops.endor_decompress(vals, bm, off, n_cols=13, out=torch.empty(3, 13, device="meta", dtype=torch.float16))


def _arrays():
    w = make_weight((6, 20), torch.float16, 0.5)
    e = endor.compress(w)
    return e.values.clone(), e.bitmap.clone(), e.row_offsets.clone()


def _bad_cases():
    v, b, o = _arrays()
    yield "bitmap has 2 bytes per row", (v, b[:, :2], o, 20, None)
    yield "bitmap must be a 2-D uint8", (v, b.to(torch.int16), o, 20, None)
    yield "values must be float32, float16, bfloat16 or int8, got", (v.to(torch.float64), b, o, 20, None)
    yield "values must be 1-D", (v.view(1, -1), b, o, 20, None)
    yield "row_offsets must be int64", (v, b, o.to(torch.int32), 20, None)
    yield "row_offsets must be int64 of length", (v, b, o[:-1], 20, None)
    yield r"row_offsets must start at 0 and end at values.numel\(\)=\d+", (v[:-3], b, o, 20, None)  # values too short
    o2 = o.clone()
    o2[2], o2[3] = o[3], o[2]  # not monotone: row 1 spans rows 1 and 2, row 2 ends before it starts
    yield r"row 1: row_offsets says \d+ values but the bitmap has \d+ set bits", (v, b, o2, 20, None)
    o3 = o.clone()
    o3[1] += 1  # disagrees with the popcounts of rows 0 and 1
    yield r"row 0: row_offsets says \d+ values but the bitmap has \d+ set bits", (v, b, o3, 20, None)
    b2 = b.clone()
    b2[4, 0] ^= 1  # one bit flipped: counts disagree
    yield r"row 4: row_offsets says \d+ values but the bitmap has \d+ set bits", (v, b2, o, 20, None)
    b3 = b.clone()
    b3[0, -1] |= 0x80  # padding bit past n_cols
    yield "row 0: bitmap has bits set past n_cols=20", (v, b3, o, 20, None)
    yield r"rows\[1\]=6 is outside \[0, 6\)", (v, b, o, 20, torch.tensor([0, 6]))
    yield r"rows\[0\]=-1 is outside \[0, 6\)", (v, b, o, 20, torch.tensor([-1]))
    yield "rows must be a 1-D int64", (v, b, o, 20, torch.tensor([0.0]))


@pytest.mark.parametrize("kernel", ["native", "reference"])
@pytest.mark.parametrize("case", list(_bad_cases()), ids=lambda case: case[0][:40])
def test_bad_input_raises_clear_error(kernel, case):
    expected, args = case
    fn = torch.ops.flashllm.endor_decompress if kernel == "native" else endor_decompress_reference
    with pytest.raises(RuntimeError, match=expected):
        fn(*args)


def test_bad_out_buffer():
    v, b, o = _arrays()
    for out in (
        torch.empty(6, 20, dtype=torch.float32),
        torch.empty(5, 20, dtype=torch.float16),
        torch.empty(20, 6, dtype=torch.float16).t(),
    ):
        with pytest.raises(RuntimeError, match="out must be a contiguous"):
            torch.ops.flashllm.endor_decompress.out(v, b, o, 20, None, out=out)


def test_forcing_an_unsupported_isa_is_refused():
    with pytest.raises(ValueError, match="unknown CPU ISA"):
        _C.set_cpu_isa("neon")
