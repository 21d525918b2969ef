"""flashllm::endor_decompress: native CPU kernel (every ISA path) against the pure-torch reference and the
original weights, bitwise; opcheck; bad inputs. The CUDA and Metal bodies are tested in test_simt.py."""

import pytest
import torch

from flashllm_ext import _C, endor, ops
from flashllm_ext.ops import endor_decompress_reference

from tests.helpers.kernel_cases import DTYPES, assert_bitwise_equal, bad_decompress_cases, endor_arrays, make_weight
from tests.helpers.native import cpu_isas, forced_isa_fixture

isa = forced_isa_fixture(cpu_isas(paths=("scalar", "avx2", "avx512", "avx512vbmi2")))


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


@pytest.mark.parametrize("kernel", ["native", "reference"])
@pytest.mark.parametrize("case", list(bad_decompress_cases()), ids=lambda case: case[0][:40])
def test_bad_input_raises_clear_error(kernel, case):
    expected, args = case
    fn = torch.ops.flashllm.endor_decompress if kernel == "native" else endor_decompress_reference
    with pytest.raises(RuntimeError, match=expected):
        fn(*args)


def test_bad_out_buffer():
    v, b, o = endor_arrays()
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
