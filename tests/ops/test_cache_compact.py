"""flashllm::cache_compact (swap-delete of neuron cache rows) on the CPU: native kernel against the pure-torch
reference; opcheck and the fake kernel; bad inputs. The CUDA body is tested in test_ffn_simt.py."""

import pytest
import torch

from flashllm_ext import ops
from flashllm_ext.ops import cache_compact_reference, compaction_moves
from tests.helpers.ffn_cases import compact_state

OPS = torch.ops.flashllm


def test_compaction_moves_are_swap_delete():
    # Rows 1 and 3 are holes below the new end (6); survivors 6 and 8 fill them, ascending; 7 is deleted.
    assert compaction_moves(9, [7, 3, 1]) == [(6, 1), (8, 3)]
    assert compaction_moves(5, []) == []
    assert compaction_moves(4, [0, 1, 2, 3]) == []


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_cache_compact_matches_reference(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    capacity = int(torch.randint(1, 40, (1,), generator=g))
    num_used = int(torch.randint(0, capacity + 1, (1,), generator=g))
    c = int(torch.randint(0, num_used + 1, (1,), generator=g))
    rows = torch.randperm(num_used, generator=g)[:c]
    state = compact_state(capacity, 11, num_used, 60, torch.float32, seed)
    state = (state[0].to(dtype), state[1], state[2], state[3])
    want = [t.clone() for t in state]
    for with_bias, with_slots in ((True, True), (False, False)):
        got = [t.clone() for t in state]
        kept = ops.cache_compact(
            got[0],
            got[1],
            rows,
            num_used=num_used,
            bias=got[2] if with_bias else None,
            slot_of=got[3] if with_slots else None,
        )
        ref = [t.clone() for t in want]
        assert kept == cache_compact_reference(
            ref[0], ref[1], ref[2] if with_bias else None, ref[3] if with_slots else None, num_used, rows
        )
        assert kept == num_used - c
        for a, b in zip(got, ref):
            assert torch.equal(a, b)
    survivors = set(state[1][:num_used].tolist()) - set(state[1][rows].tolist())
    assert set(got[1][:kept].tolist()) == survivors


def test_cache_compact_bad_inputs():
    matrix, pointer, bias, slot_of = compact_state(10, 4, 6, 20, torch.float32, seed=0)
    for fn in (OPS.cache_compact, cache_compact_reference):
        for rows, match in (
            (torch.tensor([1, 1]), "twice"),
            (torch.tensor([6]), "outside"),
            (torch.tensor([-1]), "outside"),
            (torch.tensor([0.0]), "rows must be a 1-D int64"),
        ):
            with pytest.raises(RuntimeError, match=match):
                fn(matrix, pointer, bias, slot_of, 6, rows)
        with pytest.raises(RuntimeError, match="num_used=11 is outside"):
            fn(matrix, pointer, bias, slot_of, 11, torch.tensor([0]))
        with pytest.raises(RuntimeError, match="pointer must be int64"):
            fn(matrix, pointer[:5], bias, slot_of, 5, torch.tensor([0]))
        with pytest.raises(RuntimeError, match="bias must be 1-D"):
            fn(matrix, pointer, bias[:3], slot_of, 5, torch.tensor([0]))
    assert torch.equal(pointer[:6], compact_state(10, 4, 6, 20, torch.float32, seed=0)[1][:6])  # untouched


def test_opcheck():
    matrix, pointer, bias, slot_of = compact_state(12, 8, 9, 30, torch.float16, seed=1)
    # AOT dispatch cannot functionalize an in-place op that returns an int (torch refuses before running it): the
    # schema, autograd registration and fake kernel are checked.
    torch.library.opcheck(
        OPS.cache_compact,
        (matrix, pointer, bias, slot_of, 9, torch.tensor([2, 8, 0])),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )


def test_fake_kernel_checks_metadata():
    matrix, pointer, bias, slot_of = (t.to("meta") for t in compact_state(10, 4, 6, 20, torch.float32, seed=0))
    rows = torch.empty(2, dtype=torch.int64, device="meta")
    assert OPS.cache_compact(matrix, pointer, bias, slot_of, 6, rows) == 4
    with pytest.raises(RuntimeError, match="num_used=11 is outside"):
        OPS.cache_compact(matrix, pointer, bias, slot_of, 11, rows)
    with pytest.raises(RuntimeError, match="pointer must be int64"):
        OPS.cache_compact(matrix, pointer[:5], bias, slot_of, 5, rows)
    with pytest.raises(RuntimeError, match="rows must be a 1-D int64"):
        OPS.cache_compact(matrix, pointer, bias, slot_of, 6, rows.float())
