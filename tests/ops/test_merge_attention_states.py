"""flashllm::merge_attention_states (exact log-sum-exp merge of partial attention results): against a float64
merge; empty parts never give NaN; attention split over disjoint key sets and merged equals unsplit attention;
opcheck and the fake kernel; bad inputs. The CUDA kernel is tested in test_attention_simt.py."""

import math

import pytest
import torch

from flashllm_ext import ops
from flashllm_ext.ops import merge_attention_states_reference
from tests.helpers.attention_cases import (
    DTYPES,
    TOLERANCE,
    attention_case,
    attention_float64,
    merge_case,
    merge_float64,
)

OPS = torch.ops.flashllm
INF = math.inf


@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 5, 7), (4, 2, 8, 64), (7, 1, 3, 128), (3, 5, 2, 33)])
def test_merge_matches_float64(shape):
    outs, lses = merge_case(*shape, seed=sum(shape))
    for fn in (ops.merge_attention_states, merge_attention_states_reference):
        out, lse = fn(outs, lses)
        want_out, want_lse = merge_float64(outs, lses)
        assert not out.isnan().any() and not lse.isnan().any()
        torch.testing.assert_close(out, want_out.float(), **TOLERANCE)
        torch.testing.assert_close(lse, want_lse.float(), **TOLERANCE)


def test_empty_parts_give_no_nan():
    outs, lses = merge_case(3, 2, 4, 8, empty=0.0)
    lses[:, 0] = -INF  # sequence 0: every part empty
    outs[:, 0] = math.nan
    lses[1:, 1, 2] = -INF  # one head of sequence 1: only part 0 has keys
    for fn in (ops.merge_attention_states, merge_attention_states_reference):
        out, lse = fn(outs, lses)
        assert torch.equal(out[0], torch.zeros(4, 8)) and torch.equal(lse[0], torch.full((4,), -INF))
        assert torch.equal(out[1, 2], outs[0, 1, 2]) and lse[1, 2] == lses[0, 1, 2]
        assert not out.isnan().any()
        out, lse = fn(outs[:0], lses[:0])  # no parts at all
        assert torch.equal(out, torch.zeros(2, 4, 8)) and torch.equal(lse, torch.full((2, 4), -INF))


def test_nan_and_plus_inf_lse_give_nan():
    outs, lses = merge_case(3, 1, 3, 4, empty=0.0)
    lses[1, 0, 0] = math.nan
    lses[2, 0, 1] = INF
    for fn in (ops.merge_attention_states, merge_attention_states_reference):
        out, lse = fn(outs, lses)
        assert out[0, :2].isnan().all() and lse[0, :2].isnan().all()
        assert not out[0, 2].isnan().any() and not lse[0, 2].isnan()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cuts", [(0, 5, 5, 64), (0, 0, 64), (0, 1, 63, 64), (0, 17, 40, 41, 64)])
def test_split_attention_merges_to_unsplit(dtype, cuts):
    """The property INF² rests on: attention over disjoint key sets (some empty), merged, is attention over all."""
    q, k, v = attention_case(3, 8, 2, 32, cuts[-1], dtype, seed=len(cuts))
    parts = [ops.decode_attention(q, k[a:b], v[a:b]) for a, b in zip(cuts, cuts[1:])]
    out, lse = ops.merge_attention_states(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    want_out, want_lse = attention_float64(q, k, v)
    torch.testing.assert_close(out, want_out.float(), **TOLERANCE)
    torch.testing.assert_close(lse, want_lse.float(), **TOLERANCE)


def bad_cases():
    """(expected message, (outs, lses)): the inputs every kernel refuses."""
    outs, lses = merge_case(2, 3, 4, 8)
    yield "outs must be a 4-D float32", (outs[0], lses)
    yield "outs must be a 4-D float32", (outs.half(), lses)
    yield "lses must be a 3-D float32", (outs, lses[0])
    yield "lses must be a 3-D float32", (outs, lses.double())
    yield r"lses must be \[P, B, H\] = \[2, 3, 4\]", (outs, lses[:, :, :3])
    yield r"lses must be \[P, B, H\] = \[2, 3, 4\]", (outs, lses[:1])


@pytest.mark.parametrize("match,args", list(bad_cases()))
def test_bad_inputs_are_refused(match, args):
    for fn in (OPS.merge_attention_states, merge_attention_states_reference):
        with pytest.raises(RuntimeError, match=match):
            fn(*args)


def test_fake_kernel_checks_metadata():
    outs, lses = (t.to("meta") for t in merge_case(3, 2, 4, 8))
    out, lse = OPS.merge_attention_states(outs, lses)
    assert out.shape == (2, 4, 8) and lse.shape == (2, 4)
    with pytest.raises(RuntimeError, match="lses must be"):
        OPS.merge_attention_states(outs, lses[:, :1])


def test_opcheck():
    outs, lses = merge_case(3, 2, 4, 8)
    outs = torch.nan_to_num(outs)  # opcheck compares gradients and results; NaN never equals itself
    torch.library.opcheck(OPS.merge_attention_states.default, (outs, lses))
