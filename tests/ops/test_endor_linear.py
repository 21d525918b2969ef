"""flashllm::endor_linear: the native CPU kernel (every ISA path) against the pure-torch reference (exactly, on
values whose float32 sums are exact) and against F.linear of the dense weight (within float32 tolerance); opcheck;
fake kernel; bad inputs. The CUDA and Metal bodies are tested in test_endor_linear_simt.py, the MLX backend in
test_mlx_endor_linear.py, the real GPU in test_cuda.py."""

import pytest
import torch
import torch.nn.functional as F

from flashllm_ext import endor, ops
from flashllm_ext.ops import endor_linear_reference
from tests.helpers.native import cpu_isas, forced_isa_fixture
from tests.helpers.kernel_cases import BAD_LINEAR_CASES, LINEAR_DTYPES, linear_case

isa = forced_isa_fixture(cpu_isas(paths=("scalar", "avx2", "avx512", "avx512vbmi2", "avx512bf16")))

# (rows, cols): single element, odd sizes, columns a multiple of 8/16/32 and not, a row tail after full 32-column
# steps, a long row.
SHAPES = [(1, 1), (7, 13), (5, 64), (6, 24), (4, 40), (9, 257), (3, 1000), (33, 100)]
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 11]  # every register group size, then two groups


def linear(x, e, bias=None):
    return ops.endor_linear(x, e.values, e.bitmap, e.row_offsets, n_cols=e.shape[1], bias=bias)


def assert_equal(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("dtype", LINEAR_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_native_matches_reference_exactly(isa, dtype, shape):
    for n_tok in TOKENS:
        x, _, e, b = linear_case(n_tok, shape, dtype, seed=n_tok + shape[1])
        for bias in (b, None):
            want = endor_linear_reference(x, e.values, e.bitmap, e.row_offsets, shape[1], bias)
            assert_equal(linear(x, e, bias), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float32_x_with_half_values(isa, dtype):
    x, w, e, b = linear_case(4, (9, 257), dtype, x_dtype=torch.float32)
    got = linear(x, e, b)
    assert got.dtype == torch.float32
    assert_equal(got, F.linear(x, w.float(), b))


@pytest.mark.parametrize("dtype", LINEAR_DTYPES)
def test_matches_dense_linear_on_random_weights(isa, dtype):
    # Gaussian values: sums are not exact, so within float32 accumulation tolerance of F.linear on the dense weight.
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(70, 515, generator=g) / 20).to(dtype)
    w[torch.rand(70, 515, generator=g) < 0.5] = 0
    x, b = torch.randn(3, 515, generator=g).to(dtype), torch.randn(70, generator=g).to(dtype)
    want = F.linear(x.float(), w.float(), b.float()).to(dtype)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(linear(x, endor.compress(w), b), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("density", [0.0, 1.0])
def test_all_zero_and_full_weights(isa, density):
    x, w, e, b = linear_case(3, (5, 77), torch.float16, density=density)
    assert_equal(linear(x, e, b), F.linear(x.float(), w.float(), b.float()).half())


def test_empty_rows_and_full_rows_in_one_weight(isa):
    x, w, e, _ = linear_case(2, (6, 45), torch.bfloat16)  # row 0 all zeros, row 1 no zero (linear_case)
    assert e.row_offsets[1] == 0 and e.row_offsets[2] == 45
    got = linear(x, e)
    assert torch.equal(got[:, 0], torch.zeros(2, dtype=torch.bfloat16))
    assert_equal(got, F.linear(x.float(), w.float()).bfloat16())


def test_non_contiguous_bf16_x(isa):
    # Wide enough for whole 64-column steps: the avx512bf16 level reads x as bf16, copied contiguous first.
    x, w, e, b = linear_case(11, (7, 200), torch.bfloat16)
    xt = x.t().contiguous().t()
    assert not xt.is_contiguous()
    want = endor_linear_reference(x, e.values, e.bitmap, e.row_offsets, 200, b)
    assert_equal(linear(xt, e, b), want)
    assert_equal(linear(x[1::2], e, b), want[1::2])  # strided rows


def test_non_contiguous_inputs(isa):
    x, w, e, b = linear_case(8, (7, 36), torch.float32)
    xt = x.t().contiguous().t()  # column-major
    assert not xt.is_contiguous()
    assert_equal(linear(xt, e, b), F.linear(x, w, b))
    assert_equal(linear(x[::2], e, b[::1]), F.linear(x[::2], w, b))  # strided rows
    spread = torch.zeros(2 * e.values.numel(), dtype=e.values.dtype)
    spread[::2] = e.values
    assert_equal(ops.endor_linear(x, spread[::2], e.bitmap, e.row_offsets, n_cols=36), F.linear(x, w))


def test_degenerate_sizes():
    x, _, e, b = linear_case(3, (4, 10), torch.float32)
    assert linear(x[:0], e).shape == (0, 4)
    _, _, e0, _ = linear_case(3, (0, 10), torch.float32)
    assert linear(x, e0).shape == (3, 0)
    e_no_cols = endor.compress(torch.zeros(4, 0))
    assert_equal(linear(torch.zeros(3, 0), e_no_cols, b), b.expand(3, 4))


def test_llama_ffn_row_block():
    # A block of rows of Llama-2-7B's down projection (11008 columns): long rows through every step of the kernel.
    x, w, e, b = linear_case(4, (64, 11008), torch.float16)
    assert_equal(linear(x, e, b), endor_linear_reference(x, e.values, e.bitmap, e.row_offsets, 11008, b))


@pytest.mark.parametrize("dtype", LINEAR_DTYPES)
def test_opcheck(dtype):
    x, _, e, b = linear_case(3, (9, 21), dtype)
    args = (x, e.values, e.bitmap, e.row_offsets, 21)
    torch.library.opcheck(torch.ops.flashllm.endor_linear.default, args)
    torch.library.opcheck(torch.ops.flashllm.endor_linear.default, args + (b,))


def test_meta_tensors_give_shapes():
    meta = {"device": "meta"}
    vals = torch.empty(10, dtype=torch.float16, **meta)
    bm = torch.empty(4, 2, dtype=torch.uint8, **meta)
    off = torch.empty(5, dtype=torch.int64, **meta)
    x = torch.empty(3, 13, dtype=torch.float32, **meta)
    assert ops.endor_linear(x, vals, bm, off, n_cols=13).shape == (3, 4)
    with pytest.raises(RuntimeError, match="x has 13 columns but the weight has n_cols=12"):
        ops.endor_linear(x, vals, bm, off, n_cols=12)
    with pytest.raises(RuntimeError, match=r"bias must be torch.float32 of shape \[rows=4\]"):
        ops.endor_linear(x, vals, bm, off, n_cols=13, bias=torch.empty(4, dtype=torch.float16, **meta))


def test_tensors_on_two_devices_are_refused():
    x, _, e, _ = linear_case(2, (4, 10), torch.float32)
    with pytest.raises(RuntimeError, match="endor_linear: x is on meta but values is on cpu"):
        ops.endor_linear(x.to("meta"), e.values, e.bitmap, e.row_offsets, n_cols=10)


@pytest.mark.parametrize("kernel", ["native", "reference"])
@pytest.mark.parametrize("case", BAD_LINEAR_CASES, ids=lambda case: case[0][:50])
def test_bad_input_raises_clear_error(kernel, case):
    expected, args = case
    fn = torch.ops.flashllm.endor_linear if kernel == "native" else endor_linear_reference
    with pytest.raises(RuntimeError, match=expected):
        fn(*args)
