"""flashllm::quantized_sparse_ffn and its block formats: blocks bit for bit as gguf writes and reads them; the CPU
kernel (every ISA path) against the pure-torch reference on odd shapes, 1 and 8 tokens, non-contiguous x; the
reference against dense math on the dequantized weights; opcheck, the fake kernel and bad inputs."""

import re
from pathlib import Path

import pytest
import torch

from flashllm_ext import ops
from flashllm_ext.ops import quantized_sparse_ffn_reference
from flashllm_ext.ops.blocks import (
    BLOCK_FORMATS,
    BundleFormat,
    dequantize_rows,
    quantize_rows,
    quantize_x_blocks,
)
from tests.helpers.ffn_cases import assert_close, bad_quantized_ffn_cases, ffn_case, quantized_case
from tests.helpers.native import cpu_isas, forced_isa_fixture

OPS = torch.ops.flashllm
FORMATS = [BundleFormat(i, o) for i in BLOCK_FORMATS for o in BLOCK_FORMATS]

isa = forced_isa_fixture(cpu_isas(highest="avx512vnni"))


# ------------------------------------------------------------------------------------------------ blocks
@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
def test_blocks_are_gguf_blocks_bit_for_bit(fmt):
    gguf = pytest.importorskip("gguf")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(9, 128, generator=g) * 0.05
    w[0, :32] = 0  # an all-zero block: scale 0
    w[1, 40] = 3.0  # one large weight; Q4_0's scale follows its sign
    w[2, 64:96] = -w[2, 64:96].abs()  # one-signed blocks
    qtype = gguf.GGMLQuantizationType(BLOCK_FORMATS[fmt].ggml_type)
    theirs = gguf.quants.quantize(w.numpy(), qtype)
    ours = quantize_rows(w, fmt)
    assert ours.numpy().tobytes() == theirs.tobytes()
    want = torch.from_numpy(gguf.quants.dequantize(theirs, qtype).copy())
    assert torch.equal(dequantize_rows(ours, fmt, 128).view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
def test_rows_not_a_multiple_of_the_block_are_zero_padded(fmt):
    w = torch.randn(3, 37)
    codes = quantize_rows(w, fmt)
    assert codes.shape == (3, 2 * BLOCK_FORMATS[fmt].block_bytes)
    back = dequantize_rows(codes, fmt, 37)
    assert back.shape == (3, 37)
    step = {8: 1 / 127, 4: 1 / 7}[BLOCK_FORMATS[fmt].bits] * w.abs().max()
    assert (back - w).abs().max() <= step


def test_x_blocks_round_half_away_from_zero():
    x = torch.tensor([[127.0, 0.5, -0.5, 1.5, -2.5] + [0.0] * 27])
    codes, scale = quantize_x_blocks(x)
    assert scale.tolist() == [[1.0]]
    assert codes[0, 0, :5].tolist() == [127, 1, -1, 2, -3]


def test_bad_block_arguments():
    with pytest.raises(ValueError, match="block format must be one of"):
        quantize_rows(torch.randn(2, 32), "q5_0")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_rows(torch.tensor([[float("nan")] * 32]), "q8_0")
    with pytest.raises(ValueError, match=r"codes must be uint8 \[R, 34\]"):
        dequantize_rows(torch.zeros(2, 33, dtype=torch.uint8), "q8_0", 32)
    with pytest.raises(ValueError, match="'<in format>\\+<down format>'"):
        BundleFormat.parse("q4_0")


# ------------------------------------------------------------------------------------------------ kernel
@pytest.mark.parametrize("layout", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("glu,act", [(False, "relu"), (True, "silu"), (True, "gelu"), (True, "gelu_tanh")])
@pytest.mark.parametrize("n_tok", [1, 3, 8, 11])
def test_native_matches_reference(isa, layout, glu, act, n_tok):
    d, capacity, num_used = 77, 40, 33  # d: two whole blocks and a partial one
    x, m, b = quantized_case(n_tok, d, capacity, glu, layout, seed=n_tok)
    index = torch.tensor([32, 3, 3, 0, 17, 22, 31, 8])  # any order, repeats count twice
    for kwargs in ({}, {"index": index}, {"threshold": 0.1}, {"index": index, "threshold": 0.05}):
        for bias in (b, None):
            want = quantized_sparse_ffn_reference(x, m, num_used, bias, act, glu, layout.name, **kwargs)
            got = ops.quantized_sparse_ffn(
                x, m, num_used=num_used, activation=act, glu=glu, bundle_format=layout.name, bias=bias, **kwargs
            )
            assert_close(got, want)


@pytest.mark.parametrize("d", [1, 31, 32, 33, 64, 200])
def test_odd_hidden_sizes(isa, d):
    for layout in (BundleFormat("q4_0", "q8_0"), BundleFormat("q4_1", "q4_1")):
        x, m, b = quantized_case(2, d, 9, True, layout, seed=d)
        for num_used in (0, 9):
            assert_close(
                ops.quantized_sparse_ffn(
                    x, m, num_used=num_used, activation="silu", glu=True, bundle_format=layout.name, bias=b
                ),
                quantized_sparse_ffn_reference(x, m, num_used, b, "silu", True, layout.name),
            )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_tokens(isa, dtype):
    layout = BundleFormat("q8_0", "q8_0")
    x, m, b = quantized_case(4, 96, 20, False, layout, dtype=dtype)
    assert_close(
        ops.quantized_sparse_ffn(x, m, num_used=20, activation="relu", glu=False, bundle_format=layout.name, bias=b),
        quantized_sparse_ffn_reference(x, m, 20, b, "relu", False, layout.name),
    )


def test_parallel_path_and_non_contiguous_x(isa):
    # 2000 rows of 3 x 256 weights in q8_0 (816 bytes): past the 256 KiB below which the kernel stays on one thread.
    layout = BundleFormat("q8_0", "q8_0")
    _, m, _ = quantized_case(1, 256, 2000, True, layout)
    x = torch.randn(256, 5).t()
    assert_close(
        ops.quantized_sparse_ffn(x, m, num_used=2000, activation="silu", glu=True, bundle_format=layout.name),
        quantized_sparse_ffn_reference(x, m, 2000, None, "silu", True, layout.name),
    )


@pytest.mark.parametrize("layout", [BundleFormat("q8_0", "q8_0"), BundleFormat("q4_1", "q8_0")], ids=str)
def test_reference_is_the_ffn_of_the_dequantized_weights(layout):
    """The rounding of x is the only difference from dense math on the dequantized weights: within 1% for q8."""
    d, n = 128, 64
    x, m, _ = quantized_case(2, d, n, True, layout, bias=False)
    w = layout.dequantize(m, d, True)
    up, gate, down = w[:, :d], w[:, d : 2 * d], w[:, 2 * d :]
    dense = (torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())) @ down
    got = quantized_sparse_ffn_reference(x, m, n, None, "silu", True, layout.name)
    assert (got - dense).norm() <= 0.01 * dense.norm()


def test_opcheck():
    layout = BundleFormat("q4_0", "q8_0")
    x, m, b = quantized_case(3, 64, 12, True, layout)
    torch.library.opcheck(
        OPS.quantized_sparse_ffn,
        (x, m, 10, b, "silu", True, layout.name),
        {"index": torch.tensor([1, 4]), "threshold": 0.1},
    )


@pytest.mark.parametrize("case", bad_quantized_ffn_cases(), ids=lambda c: c[0][:30])
def test_bad_inputs(case):
    match, args, kwargs = case
    for fn in (OPS.quantized_sparse_ffn, quantized_sparse_ffn_reference):
        with pytest.raises(RuntimeError, match=match):
            fn(*args, **kwargs)


@pytest.mark.parametrize(
    "case", [c for c in bad_quantized_ffn_cases() if not c[0].startswith(r"index\[")], ids=lambda c: c[0][:30]
)
def test_fake_kernel_refuses_bad_metadata(case):
    match, args, kwargs = case
    meta = lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v  # noqa: E731
    with pytest.raises(RuntimeError, match=match):
        OPS.quantized_sparse_ffn(*map(meta, args), **{k: meta(v) for k, v in kwargs.items()})


def test_block_codes_match_the_native_header():
    header = (Path(__file__).parents[2] / "csrc/common/block_formats.h").read_text()
    codes = dict(re.findall(r"kQ(\w+) = (\d+)", header))
    assert {f.name: f.code for f in BLOCK_FORMATS.values()} == {"q" + k.lower(): int(v) for k, v in codes.items()}
    sizes = re.search(r"FMT == kQ8_0\s+\? (\d+)\s+: FMT == kQ4_0 \? (\d+)\s+: (\d+);", header).groups()
    assert [BLOCK_FORMATS[f].block_bytes for f in ("q8_0", "q4_0", "q4_1")] == [int(s) for s in sizes]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_input_gives_nan_not_garbage(isa, bad):
    layout = BundleFormat("q4_0", "q8_0")
    x, m, _ = quantized_case(2, 64, 8, True, layout, bias=False)
    x[1, 40] = bad
    for y in (
        ops.quantized_sparse_ffn(x, m, num_used=8, activation="silu", glu=True, bundle_format=layout.name),
        quantized_sparse_ffn_reference(x, m, 8, None, "silu", True, layout.name),
    ):
        assert bool(torch.isfinite(y[0]).all()) and bool(torch.isnan(y[1]).all())
