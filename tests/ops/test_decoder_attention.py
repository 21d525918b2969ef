"""flashllm::decoder_attention (the attention half of a Llama-family decoder layer for one decode token) on the
CPU: native kernel against the pure-torch reference over head layouts, dtypes, biases, q/k norms, windows and
positions, the KV caches written at exactly one position; projection weights held as rows of GGUF blocks; opcheck
and the fake kernel; bad inputs refused with the same words on both paths."""

import pytest
import torch

from flashllm_ext import ops
from flashllm_ext.ops import decoder_attention_reference
from flashllm_ext.ops.blocks import dequantize_rows, quantize_rows

OPS = torch.ops.flashllm


def case(
    d=64,
    n_q=4,
    n_kv=2,
    head_dim=16,
    length=12,
    w_dtype=torch.float16,
    kv_dtype=torch.float16,
    bias=False,
    qk_norm=False,
    seed=0,
):
    """The op's positional arguments but position, window, eps and scale (x, norms, weights, tables, caches)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    rows = (n_q + 2 * n_kv) * head_dim
    angles = randn(head_dim // 2)
    return [
        randn(1, d),
        randn(d).abs() + 0.5,
        randn(rows, d, scale=d**-0.5).to(w_dtype),
        randn(rows).to(w_dtype) if bias else None,
        randn(head_dim).abs() + 0.5 if qk_norm else None,
        randn(head_dim).abs() + 0.5 if qk_norm else None,
        torch.cat((angles.cos(), angles.cos())),
        torch.cat((-angles.sin(), angles.sin())),
        randn(length, 1, n_kv, head_dim).to(kv_dtype),
        randn(length, 1, n_kv, head_dim).to(kv_dtype),
        randn(d, n_q * head_dim, scale=(n_q * head_dim) ** -0.5).to(w_dtype),
        randn(d).to(w_dtype) if bias else None,
        randn(d).abs() + 0.5,
    ]


def as_blocks(args, qkv_format, o_format):
    """The case with qkv_weight / o_weight as rows of blocks in these formats (None: left as floats), their biases
    float32."""
    args = list(args)
    for weight, bias, fmt in ((2, 3, qkv_format), (10, 11, o_format)):
        if fmt is not None:
            args[weight] = quantize_rows(args[weight].float(), fmt)
            args[bias] = None if args[bias] is None else args[bias].float()
    return args


def run_both(args, position, window=0, eps=1e-5, scale=0.25, formats=(None, None)):
    """(native outputs, reference outputs, native caches, reference caches), each path on its own cache copies."""
    native, reference = list(args), list(args)
    for i in (8, 9):
        native[i], reference[i] = args[i].clone(), args[i].clone()
    got = OPS.decoder_attention(*native, position, window, eps, scale, *formats)
    want = decoder_attention_reference(*reference, position, window, eps, scale, *formats)
    return got, want, native[8:10], reference[8:10]


@pytest.mark.parametrize(
    "shape",
    [
        dict(),
        dict(n_q=4, n_kv=4),
        dict(n_q=6, n_kv=1, head_dim=8),
        dict(d=37, n_q=3, n_kv=1, head_dim=6),
        dict(d=576, n_q=9, n_kv=3, head_dim=64),
    ],
)
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", [dict(), dict(bias=True), dict(qk_norm=True), dict(bias=True, qk_norm=True)])
def test_matches_reference(shape, w_dtype, variant):
    for kv_dtype in (torch.float16, torch.float32):
        args = case(**shape, **variant, w_dtype=w_dtype, kv_dtype=kv_dtype)
        for position, window in ((0, 0), (5, 0), (11, 0), (7, 3), (7, 1), (4, 40)):
            got, want, got_caches, want_caches = run_both(args, position, window)
            # A float16 cache rounds the new key and value: where the two paths' float32 sums differ in the last bit
            # an element can round the other way (seen on AVX2), one float16 step carried through o_proj.
            tolerance = 1e-4 if kv_dtype == torch.float32 else 5e-4
            for g, w in zip(got, want):
                assert g.dtype == torch.float32 and g.shape == w.shape
                torch.testing.assert_close(g, w, rtol=1e-4, atol=tolerance)
            for before, g, w in zip(args[8:10], got_caches, want_caches):
                torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-3)  # the new row, rounded to the cache dtype
                others = torch.arange(before.shape[0]) != position
                assert torch.equal(g[others], before[others])  # no other row touched


@pytest.mark.parametrize(
    "shape", [dict(), dict(d=37, n_q=3, n_kv=1, head_dim=6), dict(d=576, n_q=9, n_kv=3, head_dim=64)]
)
@pytest.mark.parametrize("formats", [("q4_0", "q4_0"), ("q4_1", "q8_0"), ("q8_0", None), (None, "q4_1")])
@pytest.mark.parametrize("variant", [dict(), dict(bias=True, qk_norm=True)])
def test_blocks_match_reference(shape, formats, variant):
    """Rows of blocks go through quantized_linear (x rounded per block of 32): the reference rounds it the same."""
    args = as_blocks(case(**shape, **variant, kv_dtype=torch.float32), *formats)
    for position, window in ((0, 0), (11, 0), (7, 3)):
        got, want, got_caches, want_caches = run_both(args, position, window, formats=formats)
        for g, w in zip(got, want):
            assert g.dtype == torch.float32 and g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        for g, w in zip(got_caches, want_caches):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_blocks_are_the_dequantized_weights():
    """Within the int8 rounding of x: the outputs of a q8_0 layer are those of its dequantized float weights."""
    floats = case(d=64, w_dtype=torch.float32, kv_dtype=torch.float32, bias=True)
    blocks = as_blocks(floats, "q8_0", "q8_0")
    dequantized = list(blocks)
    for i in (2, 10):
        dequantized[i] = dequantize_rows(blocks[i], "q8_0", floats[i].shape[1])
    got = run_both(blocks, 5, formats=("q8_0", "q8_0"))[0]
    want = run_both(dequantized, 5)[0]
    for g, w in zip(got, want):
        assert (g - w).norm() <= 0.01 * w.norm()


def test_opcheck_and_the_wrapper():
    args = case(bias=True, qk_norm=True)
    torch.library.opcheck(OPS.decoder_attention.default, (*args, 3, 2, 1e-5, 0.25))
    x, nw, qkv, qb, qn, kn, cos, sin, kc, vc, ow, ob, fw = args
    want = OPS.decoder_attention(x, nw, qkv, qb, qn, kn, cos, sin, kc.clone(), vc.clone(), ow, ob, fw, 3, 2, 1e-5, 0.25)
    got = ops.decoder_attention(
        x,
        nw,
        qkv,
        cos,
        sin,
        kc,
        vc,
        ow,
        fw,
        position=3,
        eps=1e-5,
        scale=0.25,
        window=2,
        qkv_bias=qb,
        o_bias=ob,
        q_norm=qn,
        k_norm=kn,
    )
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    blocks = as_blocks(args, "q4_1", "q8_0")
    torch.library.opcheck(OPS.decoder_attention.default, (*blocks, 3, 2, 1e-5, 0.25, "q4_1", "q8_0"))


def _bad(index, value):
    args = case()
    args[index] = value(args)
    return args


@pytest.mark.parametrize(
    "args,position,message",
    [
        (_bad(0, lambda a: a[0].half()), 0, r"x must be a float32 tensor \[1, d\]"),
        (_bad(0, lambda a: torch.randn(2, 64)), 0, r"x must be a float32 tensor \[1, d\]"),
        (_bad(2, lambda a: a[2][:-16]), 0, r"qkv_weight must be a float tensor \[\(Hq \+ 2 Hkv\) D, d=64\]"),
        (_bad(2, lambda a: a[2].double()), 0, "qkv_weight must be"),
        (_bad(10, lambda a: a[10].float()), 0, "o_weight must be"),
        (_bad(3, lambda a: torch.randn(5).half()), 0, r"qkv_bias must be .*\[128\]"),
        (_bad(1, lambda a: a[1].half()), 0, r"norm_weight must be float32 \[64\]"),
        (_bad(6, lambda a: a[6][:8]), 0, r"cos must be float32 \[16\]"),
        (_bad(4, lambda a: torch.ones(16)), 0, "give both q_norm and k_norm or neither"),
        (_bad(9, lambda a: a[9].float()), 0, "k_cache and v_cache must be float tensors"),
        (case(), 12, "position 12 is outside the cache's 12 tokens"),
        ((*case(), "q4_0", None), 0, r"qkv_weight must be uint8 rows of q4_0 blocks \[\(Hq \+ 2 Hkv\) D, d=64\]"),
        ((*as_blocks(case(), "q4_0", None), "q5_0", None), 0, r"qkv_format must be one of \('q8_0', 'q4_0', 'q4_1'\)"),
        ((*as_blocks(case(), None, "q8_0"), None, "q4_0"), 0, "o_weight must be uint8 rows of q4_0 blocks"),
        ((*as_blocks(case(), None, "q8_0"), None, None), 0, "o_weight must be torch.float16|o_weight must be Half"),
        (
            (
                *as_blocks(case(bias=True), "q8_0", None)[:3],
                torch.zeros(128).half(),
                *as_blocks(case(), "q8_0", None)[4:],
                "q8_0",
                None,
            ),
            0,
            r"qkv_bias must be .*\[128\]",
        ),
        (case(), -1, "position -1 is outside"),
    ],
)
def test_bad_inputs_raise_clearly(args, position, message):
    tensors, formats = args[:13], args[13:]
    for fn in (OPS.decoder_attention, decoder_attention_reference):
        with pytest.raises(RuntimeError, match=message):
            fn(*tensors, position, 0, 1e-5, 0.25, *formats)
