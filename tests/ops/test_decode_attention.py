"""flashllm::decode_attention (one query token per sequence over token-major K/V, GQA aware): the reference against
torch SDPA and a float64 direct computation; the native CPU kernel against the reference over many shapes and
dtypes; opcheck and the fake kernel; bad inputs. The CUDA kernel is tested in test_attention_simt.py."""

import math

import pytest
import torch
import torch.nn.functional as F

from flashllm_ext import native_available, ops
from flashllm_ext.ops import decode_attention_reference
from tests.helpers.attention_cases import DTYPES, TOLERANCE, attention_case, attention_float64
from tests.helpers.native import cpu_isas, forced_isa_fixture

OPS = torch.ops.flashllm


def sdpa(q, k, v, scale=None):
    """torch's scaled_dot_product_attention on the same inputs, kv heads repeated for GQA: out [B, Hq, D]."""
    group = q.shape[1] // k.shape[2]
    keys = k.float().permute(1, 2, 0, 3).repeat_interleave(group, dim=1)
    values = v.float().permute(1, 2, 0, 3).repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q.float()[:, :, None], keys, values, scale=scale)[:, :, 0]


@pytest.mark.parametrize(
    "shape", [(1, 1, 1, 1, 1), (2, 4, 2, 8, 5), (3, 8, 1, 64, 64), (2, 6, 6, 128, 300), (1, 14, 2, 7, 33)]
)
def test_reference_matches_sdpa_and_float64(shape):
    batch, n_q, n_kv, head_dim, seq = shape
    q, k, v = attention_case(batch, n_q, n_kv, head_dim, seq, torch.float32, seed=seq)
    for scale in (None, 0.3):
        out, lse = decode_attention_reference(q, k, v, scale)
        assert out.dtype == lse.dtype == torch.float32
        torch.testing.assert_close(out, sdpa(q, k, v, scale), atol=1e-5, rtol=1e-5)
        want_out, want_lse = attention_float64(q, k, v, scale)
        torch.testing.assert_close(out, want_out.float(), **TOLERANCE)
        torch.testing.assert_close(lse, want_lse.float(), **TOLERANCE)


def test_empty_sequence_gives_zeros_and_minus_inf():
    q, k, v = attention_case(2, 4, 2, 8, 0, torch.float16)
    for fn in (ops.decode_attention, decode_attention_reference):
        out, lse = fn(q, k, v)
        assert torch.equal(out, torch.zeros(2, 4, 8)) and torch.equal(lse, torch.full((2, 4), -math.inf))


def bad_cases():
    """(expected message, (q, k, v, scale)): the inputs every kernel refuses."""
    q, k, v = attention_case(2, 4, 2, 8, 3, torch.float32)
    yield "q must be a 3-D", (q[0], k, v, None)
    yield "q must be a 3-D float32/float16/bfloat16", (q.double(), k.double(), v.double(), None)
    yield "k must be a 4-D tensor", (q, k[0], v, None)
    yield "v must be a 4-D tensor", (q, k, v.half(), None)
    yield "k must be a 4-D tensor", (q, k.bfloat16(), v.bfloat16(), None)
    yield "k and v must have the same shape", (q, k, v[:2], None)
    yield r"k and v must be \[S, B=2, Hkv, D=8\]", (q, k[:, :1], v[:, :1], None)
    yield r"k and v must be \[S, B=2, Hkv, D=8\]", (q, k[..., :4], v[..., :4], None)
    yield "Hq=4 must be a positive multiple of the kv heads Hkv=3", (q, k[:, :, [0, 1, 0]], v[:, :, [0, 1, 0]], None)
    yield "Hq=4 must be a positive multiple of the kv heads Hkv=0", (q, k[:, :, :0], v[:, :, :0], None)
    yield "head_dim D must be >= 1", (q[..., :0], k[..., :0], v[..., :0], None)
    yield "scale must be finite", (q, k, v, math.nan)


@pytest.mark.parametrize("match,args", list(bad_cases()))
def test_bad_inputs_are_refused(match, args):
    for fn in (OPS.decode_attention, decode_attention_reference):
        with pytest.raises(RuntimeError, match=match):
            fn(*args)


def test_fake_kernel_checks_metadata():
    q, k, v = (t.to("meta") for t in attention_case(3, 8, 2, 16, 7, torch.bfloat16))
    out, lse = OPS.decode_attention(q, k, v)
    assert out.shape == (3, 8, 16) and lse.shape == (3, 8) and out.dtype == lse.dtype == torch.float32
    with pytest.raises(RuntimeError, match="positive multiple"):
        OPS.decode_attention(q[:, :7], k, v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(dtype):
    q, k, v = attention_case(2, 4, 2, 16, 9, dtype)
    torch.library.opcheck(OPS.decode_attention.default, (q, k, v, None))
    torch.library.opcheck(OPS.decode_attention.default, (q, k, v, 0.5))


# ---- the native CPU kernel -------------------------------------------------------------------------------------
isa = forced_isa_fixture(cpu_isas(highest="avx512"))  # no VBMI2-specific path

# (B, Hq, Hkv, D, S): head sizes 1, 7, odd, 64, 128 and past one AVX-512 vector; GQA groups of 1 to 8 (groups of 5
# and 6 split into register groups of 4 + 1 and 4 + 2); S empty, one token, under one chunk (32), several chunks
# with a ragged last one; item counts that do and do not split evenly over the threads.
SHAPES = [
    (1, 1, 1, 1, 1),
    (1, 1, 1, 7, 5),
    (7, 7, 7, 64, 64),
    (2, 7, 1, 128, 300),
    (3, 64, 8, 64, 5),
    (1, 8, 2, 128, 300),
    (7, 14, 2, 33, 64),
    (2, 12, 3, 100, 1),
    (64, 1, 1, 7, 5),
    (2, 4, 4, 130, 0),
    (1, 6, 3, 17, 65),
    (5, 9, 1, 1, 33),
    (2, 10, 2, 48, 40),
    (1, 6, 1, 20, 31),
    (3, 10, 5, 128, 97),
]


def test_native_kernel_is_registered():
    if native_available:
        for op in ("decode_attention", "merge_attention_states"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"flashllm::{op}", "CPU"), op


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_native_matches_float64(isa, dtype, shape):
    q, k, v = attention_case(*shape, dtype, seed=sum(shape))
    out, lse = ops.decode_attention(q, k, v)
    want_out, want_lse = attention_float64(q, k, v)
    torch.testing.assert_close(out, want_out.float(), **TOLERANCE)
    torch.testing.assert_close(lse, want_lse.float(), **TOLERANCE)
    ref_out, ref_lse = decode_attention_reference(q, k, v)
    torch.testing.assert_close(out, ref_out, **TOLERANCE)
    torch.testing.assert_close(lse, ref_lse, **TOLERANCE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_non_contiguous_inputs(isa, dtype):
    """k and v as views of one fused KV buffer, q permuted, sequence-major k, and a head_dim with a non-unit stride."""
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(70, 3, 2, 4, 40, generator=g).to(dtype)  # [S, B, k|v, Hkv, D]
    q = torch.randn(8, 3, 40, generator=g).to(dtype).permute(1, 0, 2)  # [B, Hq, D], not contiguous
    k, v = kv[:, :, 0], kv[:, :, 1]
    sequence_major = k.transpose(0, 1).contiguous().transpose(0, 1)
    strided = torch.randn(70, 3, 4, 40, 2, generator=g).to(dtype)[..., 0]  # head_dim stride 2
    for keys, values in ((k, v), (sequence_major, v), (strided, v), (k, strided)):
        assert not (keys.is_contiguous() and values.is_contiguous())
        out, lse = ops.decode_attention(q, keys, values, scale=0.2)
        want_out, want_lse = attention_float64(q, keys, values, 0.2)
        torch.testing.assert_close(out, want_out.float(), **TOLERANCE)
        torch.testing.assert_close(lse, want_lse.float(), **TOLERANCE)


def test_native_large_scores_do_not_overflow(isa):
    """Scores in the hundreds: the online softmax rescales by the running max instead of exponentiating them."""
    q, k, v = attention_case(2, 4, 2, 64, 100, torch.float32, seed=9)
    k[50:] *= 40  # the max moves up in a later chunk
    out, lse = ops.decode_attention(q, k, v, scale=1.0)
    want_out, want_lse = attention_float64(q, k, v, 1.0)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out, want_out.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse.float(), atol=1e-4, rtol=1e-5)


def test_native_far_below_the_max_and_nan(isa):
    """Scores 100s below the max underflow to weight 0 (the vector exp's cut-off) and nothing else changes; a NaN
    in q makes only its own (b, h) NaN."""
    q, k, v = attention_case(2, 4, 2, 16, 70, torch.float32, seed=4)
    k[3] *= 200  # one token's scores far above or below the others
    for fn in (ops.decode_attention, decode_attention_reference):
        out, lse = fn(q, k, v, scale=1.0)
        want_out, want_lse = attention_float64(q, k, v, 1.0)
        torch.testing.assert_close(out, want_out.float(), **TOLERANCE)
        torch.testing.assert_close(lse, want_lse.float(), **TOLERANCE)
    q[1, 2, 5] = math.nan
    for fn in (ops.decode_attention, decode_attention_reference):
        out, lse = fn(q, k, v)
        assert out[1, 2].isnan().all() and lse[1, 2].isnan()
        out[1, 2], lse[1, 2] = 0, 0
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
