"""flashllm::quantized_linear: the CPU kernel (every ISA path) against the pure-torch reference on odd shapes, 1 to 11
tokens, half-precision and non-contiguous x; the reference against dense math on the dequantized weights; opcheck,
the fake kernel and bad inputs."""

import pytest
import torch

from flashllm_ext import ops
from flashllm_ext.ops import quantized_linear_reference
from flashllm_ext.ops.blocks import BLOCK_FORMATS, dequantize_rows
from tests.helpers.ffn_cases import assert_close, bad_quantized_linear_cases, quantized_linear_case
from tests.helpers.native import cpu_isas, forced_isa_fixture

OPS = torch.ops.flashllm

isa = forced_isa_fixture(cpu_isas(highest="avx512vnni"))


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
@pytest.mark.parametrize("n_tok", [1, 3, 8, 11, 17, 40])  # past 16 tokens: the GEMM path
@pytest.mark.parametrize("d", [1, 33, 64, 200])
def test_native_matches_reference(isa, fmt, n_tok, d):
    x, w, b = quantized_linear_case(n_tok, d, 37, fmt, seed=d + n_tok)
    for bias in (b, None):
        assert_close(
            ops.quantized_linear(x, w, weight_format=fmt, bias=bias), quantized_linear_reference(x, w, fmt, bias)
        )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_and_non_contiguous_x(isa, dtype):
    x, w, b = quantized_linear_case(4, 96, 50, "q4_1", dtype)
    xt = torch.randn(96, 4).t().to(dtype)
    for inp in (x, xt):
        assert_close(
            ops.quantized_linear(inp, w, weight_format="q4_1", bias=b), quantized_linear_reference(inp, w, "q4_1", b)
        )


def test_parallel_path(isa):
    # 4096 rows of 256 columns in q8_0 (272 bytes): past the 256 KiB below which the kernel stays on one thread.
    x, w, b = quantized_linear_case(2, 256, 4096, "q8_0")
    assert_close(ops.quantized_linear(x, w, weight_format="q8_0", bias=b), quantized_linear_reference(x, w, "q8_0", b))


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
def test_reference_is_the_linear_of_the_dequantized_weight(fmt):
    """Rounding x to int8 per block is the only difference from dense math on the dequantized weight: within 1%."""
    x, w, b = quantized_linear_case(3, 128, 64, fmt)
    dense = x @ dequantize_rows(w, fmt, 128).t() + b
    got = quantized_linear_reference(x, w, fmt, b)
    assert (got - dense).norm() <= 0.01 * dense.norm()


def test_opcheck():
    x, w, b = quantized_linear_case(3, 64, 12, "q4_0")
    torch.library.opcheck(OPS.quantized_linear, (x, w, "q4_0", b))


@pytest.mark.parametrize("case", bad_quantized_linear_cases(), ids=lambda c: c[0][:30])
def test_bad_inputs(case):
    match, args = case
    for fn in (OPS.quantized_linear, quantized_linear_reference):
        with pytest.raises(RuntimeError, match=match):
            fn(*args)


@pytest.mark.parametrize("case", bad_quantized_linear_cases(), ids=lambda c: c[0][:30])
def test_fake_kernel_refuses_bad_metadata(case):
    match, args = case
    meta = lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v  # noqa: E731
    with pytest.raises(RuntimeError, match=match):
        OPS.quantized_linear(*map(meta, args))
