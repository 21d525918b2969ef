"""The CUDA build's decode_attention and merge_attention_states launchers and kernels, run through the CPU SIMT
emulation (flashllm_ext._simt) behind the host code of the real glue, against the float64 oracles. Small shapes:
every emulated GPU thread is an OS thread."""

import math

import pytest
import torch

from tests.helpers.attention_cases import (
    DTYPES,
    TOLERANCE,
    attention_case,
    attention_float64,
    merge_case,
    merge_float64,
)
from tests.helpers.native import require_simt

require_simt()
OPS = torch.ops.flashllm_simt
INF = math.inf

# (B, Hq, Hkv, D, S): one warp's worth of tokens or less (warps with no tokens), a ragged split over the 4 warps,
# head sizes 1, odd, past one lane step (32) and the largest the kernel takes (256), GQA groups of 1, 2, 5 (two head
# blocks: 4 + 1), MQA; S = 0.
SHAPES = [
    (1, 1, 1, 1, 1),
    (2, 2, 1, 7, 3),
    (1, 4, 2, 64, 37),
    (2, 5, 1, 33, 9),
    (1, 3, 3, 128, 70),
    (1, 2, 1, 256, 5),
    (3, 2, 2, 16, 0),
    (1, 10, 2, 40, 12),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_decode_attention_cuda_matches_float64(dtype, shape):
    q, k, v = attention_case(*shape, dtype, seed=sum(shape))
    out, lse = OPS.decode_attention_cuda(q, k, v)
    want_out, want_lse = attention_float64(q, k, v)
    torch.testing.assert_close(out, want_out.float(), **TOLERANCE)
    torch.testing.assert_close(lse, want_lse.float(), **TOLERANCE)


def test_decode_attention_cuda_strided_inputs():
    g = torch.Generator().manual_seed(5)
    kv = torch.randn(21, 2, 2, 2, 24, generator=g).half()  # [S, B, k|v, Hkv, D]: k and v views of one buffer
    q = torch.randn(4, 2, 24, generator=g).half().permute(1, 0, 2)
    strided = torch.randn(21, 2, 2, 24, 2, generator=g).half()[..., 0]  # head_dim stride 2: copied by the host
    for keys, values in ((kv[:, :, 0], kv[:, :, 1]), (strided, kv[:, :, 1])):
        out, lse = OPS.decode_attention_cuda(q, keys, values, 0.3)
        want_out, want_lse = attention_float64(q, keys, values, 0.3)
        torch.testing.assert_close(out, want_out.float(), **TOLERANCE)
        torch.testing.assert_close(lse, want_lse.float(), **TOLERANCE)


def test_decode_attention_cuda_bad_inputs():
    q, k, v = attention_case(1, 2, 1, 8, 3, torch.float32)
    with pytest.raises(RuntimeError, match="positive multiple"):
        OPS.decode_attention_cuda(q, k[:, :, [0, 0, 0]], v[:, :, [0, 0, 0]])
    with pytest.raises(RuntimeError, match="k and v must have the same shape"):
        OPS.decode_attention_cuda(q, k, v[:2])
    q, k, v = attention_case(1, 1, 1, 257, 2, torch.float32)
    with pytest.raises(RuntimeError, match="the GPU kernel takes head_dim D <= 256, got 257"):
        OPS.decode_attention_cuda(q, k, v)


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (3, 2, 3, 7), (5, 1, 5, 64), (2, 3, 1, 33), (0, 2, 2, 4)])
def test_merge_attention_states_cuda_matches_float64(shape):
    outs, lses = merge_case(*shape, seed=sum(shape))
    out, lse = OPS.merge_attention_states_cuda(outs, lses)
    assert not out.isnan().any() and not lse.isnan().any()
    want_out, want_lse = merge_float64(outs, lses)
    torch.testing.assert_close(out, want_out.float(), **TOLERANCE)
    torch.testing.assert_close(lse, want_lse.float(), **TOLERANCE)


def test_merge_attention_states_cuda_empty_and_special_parts():
    outs, lses = merge_case(3, 2, 3, 8, empty=0.0)
    lses[:, 0] = -INF  # every part of sequence 0 empty (its outs NaN: never read)
    outs[:, 0] = math.nan
    lses[1, 1, 0] = math.nan
    lses[2, 1, 1] = INF
    out, lse = OPS.merge_attention_states_cuda(outs.transpose(1, 2).contiguous().transpose(1, 2), lses)
    assert torch.equal(out[0], torch.zeros(3, 8)) and torch.equal(lse[0], torch.full((3,), -INF))
    assert out[1, :2].isnan().all() and lse[1, :2].isnan().all()
    want_out, want_lse = merge_float64(outs[:, 1:, 2:], lses[:, 1:, 2:])
    torch.testing.assert_close(out[1:, 2:], want_out.float(), **TOLERANCE)
    torch.testing.assert_close(lse[1:, 2:], want_lse.float(), **TOLERANCE)


def test_split_attention_merges_to_unsplit_on_the_gpu_kernels():
    q, k, v = attention_case(2, 4, 2, 32, 40, torch.bfloat16, seed=11)
    cuts = (0, 13, 13, 40)  # one part empty
    parts = [OPS.decode_attention_cuda(q, k[a:b], v[a:b]) for a, b in zip(cuts, cuts[1:])]
    out, lse = OPS.merge_attention_states_cuda(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    want_out, want_lse = attention_float64(q, k, v)
    torch.testing.assert_close(out, want_out.float(), **TOLERANCE)
    torch.testing.assert_close(lse, want_lse.float(), **TOLERANCE)
