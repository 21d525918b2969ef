"""flashllm_ext.mlx.sparse_ffn: its mlx-op fallback everywhere and, on Apple Silicon, its Metal kernels, against
the torch reference (off Apple Silicon the Metal bodies are tested through the SIMT emulation in test_ffn_simt.py);
flashllm_ext.mlx.quantized_sparse_ffn (mlx ops) against the torch reference of quantized_sparse_ffn."""

import importlib

import pytest
import torch

from flashllm_ext.ops import quantized_sparse_ffn_reference, sparse_ffn_reference
from flashllm_ext.ops.blocks import BLOCK_FORMATS, BundleFormat
from tests.helpers.ffn_cases import (
    FFN_DTYPES,
    assert_close,
    bad_ffn_cases,
    bad_quantized_ffn_cases,
    ffn_case,
    quantized_case,
)
from tests.helpers.mlx_arrays import path, to_mx, to_torch  # noqa: F401  (path: the fallback and, where it exists, Metal)

mx = pytest.importorskip("mlx.core", reason="mlx is not importable (install the [mlx] extra)")
fmlx = pytest.importorskip("flashllm_ext.mlx")


def run(x, m, num_used, bias, act, glu, index=None, threshold=0.0):
    out = fmlx.sparse_ffn(
        to_mx(x),
        to_mx(m),
        num_used,
        None if bias is None else to_mx(bias),
        act,
        glu,
        None if index is None else to_mx(index),
        threshold,
    )
    return to_torch(out, x.dtype)


@pytest.mark.parametrize("dtype", FFN_DTYPES)
@pytest.mark.parametrize("glu,act", [(False, "relu"), (True, "silu"), (False, "gelu"), (True, "gelu_tanh")])
@pytest.mark.parametrize("n_tok", [1, 4, 9])
def test_matches_reference(dtype, glu, act, n_tok):
    x, m, b = ffn_case(n_tok, 24, 30, glu, dtype, seed=n_tok)
    index = torch.tensor([29, 3, 3, 0, 11])
    for kwargs, bias in (({}, b), ({"index": index, "threshold": 0.1}, None), ({"index": index[:0]}, b)):
        assert_close(run(x, m, 30, bias, act, glu, **kwargs), sparse_ffn_reference(x, m, 30, bias, act, glu, **kwargs))


@pytest.mark.parametrize("case", [c for c in bad_ffn_cases() if "contiguous" not in c[0]], ids=lambda c: c[0][:30])
def test_bad_inputs(case):
    match, (x, m, num_used, bias, act, glu), kwargs = case
    with pytest.raises(RuntimeError, match=match):
        run(x, m, num_used, bias, act, glu, **kwargs)


def run_quantized(x, m, num_used, bias, act, glu, bundle_format, index=None, threshold=0.0):
    args = (to_mx(x), to_mx(m), num_used, None if bias is None else to_mx(bias), act, glu, bundle_format)
    out = fmlx.quantized_sparse_ffn(*args, None if index is None else to_mx(index), threshold)
    return to_torch(out, x.dtype)


@pytest.mark.parametrize("layout", [BundleFormat(i, o) for i in BLOCK_FORMATS for o in BLOCK_FORMATS], ids=str)
@pytest.mark.parametrize("glu,act", [(False, "relu"), (True, "silu")])
@pytest.mark.parametrize("dtype", FFN_DTYPES)
def test_quantized_matches_reference(layout, glu, act, dtype):
    x, m, b = quantized_case(3, 40, 30, glu, layout, dtype, seed=5)  # d = 40: the last block zero-padded
    index = torch.tensor([29, 3, 3, 0, 11])
    for kwargs, bias in (({}, b), ({"index": index, "threshold": 0.05}, None), ({"index": index[:0]}, b)):
        want = quantized_sparse_ffn_reference(x, m, 30, bias, act, glu, layout.name, **kwargs)
        assert_close(run_quantized(x, m, 30, bias, act, glu, layout.name, **kwargs), want)


@pytest.mark.parametrize(
    "case", [c for c in bad_quantized_ffn_cases() if "contiguous" not in c[0]], ids=lambda c: c[0][:30]
)
def test_quantized_bad_inputs(case):
    match, args, kwargs = case
    with pytest.raises(RuntimeError, match=match):
        run_quantized(*args, **kwargs)


def test_metal_kernel_sources_are_found_and_accepted():
    # Running them needs Metal; building the kernel objects checks every body and header file is found.
    kernels = importlib.import_module("flashllm_ext.mlx.sparse_ffn")  # the package's sparse_ffn is the op
    assert len(kernels._ffn_kernels()) == 2 and len(kernels._quantized_ffn_kernels()) == 3
