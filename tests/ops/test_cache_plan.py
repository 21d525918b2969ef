"""flashllm::cache_plan (one token's decisions of the neuron cache) on the CPU: native kernel against the
pure-torch reference; opcheck and the fake kernel; bad inputs."""

import pytest
import torch

from flashllm_ext import ops
from flashllm_ext.ops import cache_plan_reference
from tests.helpers.ffn_cases import compact_state

OPS = torch.ops.flashllm


@pytest.mark.parametrize("seed", range(20))
def test_cache_plan_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    n, capacity, window = 40, int(torch.randint(8, 30, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
    num_used = int(torch.randint(0, capacity + 1, (1,), generator=g))
    _, pointer, _, slot_of = compact_state(capacity, 1, num_used, n, torch.float32, seed)
    step = 10
    last = torch.randint(step - 5, step, (n,), generator=g)  # distinct recency per cached row: no LRU ties
    last[pointer[:num_used]] = step - 1 - torch.randperm(num_used, generator=g)
    active = torch.randint(0, n, (int(torch.randint(0, capacity, (1,), generator=g)),), generator=g)
    outs = []
    for fn in (OPS.cache_plan, cache_plan_reference):
        last_c, evict, missing = last.clone(), torch.full((capacity,), -7), torch.full((capacity,), -7)
        counts = fn(active, last_c, slot_of, pointer, num_used, step, window, evict, missing)
        w, b, m = counts
        outs.append(
            (
                list(counts),
                last_c,
                sorted(evict[:w].tolist()),
                evict[w : w + b].sort().values,
                sorted(missing[:m].tolist()),
            )
        )
    (c1, l1, e1, b1, m1), (c2, l2, e2, b2, m2) = outs
    assert c1 == c2 and torch.equal(l1, l2) and e1 == e2 and torch.equal(b1, b2) and m1 == m2


def test_cache_plan_refuses_too_many_active_and_changes_nothing():
    _, pointer, _, slot_of = compact_state(4, 1, 2, 10, torch.float32, seed=0)
    last = torch.zeros(10, dtype=torch.int64)
    for fn in (OPS.cache_plan, cache_plan_reference):
        with pytest.raises(RuntimeError, match="5 distinct active neurons but the cache holds 4"):
            fn(
                torch.tensor([0, 1, 2, 3, 4, 4]),
                last,
                slot_of,
                pointer,
                2,
                1,
                2,
                torch.empty(4, dtype=torch.int64),
                torch.empty(4, dtype=torch.int64),
            )
        with pytest.raises(RuntimeError, match="outside"):
            fn(
                torch.tensor([10]),
                last,
                slot_of,
                pointer,
                2,
                1,
                2,
                torch.empty(4, dtype=torch.int64),
                torch.empty(4, dtype=torch.int64),
            )
        assert not last.any()


def _plan_args(seed: int = 1) -> tuple:
    _, pointer, _, slot_of = compact_state(12, 1, 9, 30, torch.float32, seed)
    return (
        torch.tensor([1, 4, 4, 29]),
        torch.zeros(30, dtype=torch.int64),
        slot_of,
        pointer,
        9,
        3,
        2,
        torch.empty(12, dtype=torch.int64),
        torch.empty(12, dtype=torch.int64),
    )


def test_wrapper_passes_arguments_by_name():
    active, last, slot_of, pointer, num_used, step, window, evict, missing = _plan_args()
    want = cache_plan_reference(*_plan_args())
    got = ops.cache_plan(active, last, slot_of, pointer, evict, missing, num_used=num_used, step=step, window=window)
    assert list(got) == want and bool((last[active] == step).all())


def test_opcheck():
    # As for cache_compact, AOT dispatch cannot functionalize an in-place op returning ints: the schema, autograd
    # registration and fake kernel (unbacked sizes for the data-dependent counts) are checked.
    torch.library.opcheck(
        OPS.cache_plan, _plan_args(), test_utils=("test_schema", "test_autograd_registration", "test_faketensor")
    )


def test_bad_metadata():
    args = _plan_args()
    for fn in (OPS.cache_plan, cache_plan_reference):
        with pytest.raises(RuntimeError, match=r"every argument must be a 1-D int64 CPU tensor, got \S+ of shape"):
            fn(args[0].int(), *args[1:])
        with pytest.raises(RuntimeError, match="last_active and slot_of must both have one entry per neuron"):
            fn(args[0], args[1][:5], *args[2:])
        with pytest.raises(RuntimeError, match="evict_rows and missing need capacity=12 entries"):
            fn(*args[:7], args[7][:3], args[8])
        with pytest.raises(RuntimeError, match=r"num_used=13 is outside \[0, capacity=12\]"):
            fn(*args[:4], 13, *args[5:])
        with pytest.raises(RuntimeError, match="window must be >= 1, got 0"):
            fn(*args[:6], 0, *args[7:])


def test_corrupt_state_is_refused():
    args = list(_plan_args())
    args[2] = args[2].clone()
    args[2][args[3][4]] = 7  # slot_of no longer points back at row 4
    for fn in (OPS.cache_plan, cache_plan_reference):
        with pytest.raises(RuntimeError, match=r"pointer\[4\]=\d+ disagrees with slot_of"):
            fn(*args)


@pytest.mark.parametrize("slot", [10**6, 11, 0])
def test_active_neuron_whose_slot_is_not_its_row_is_refused(slot):
    # 10**6 is past the capacity, 11 past num_used=9, 0 a row holding another neuron: none may count as cached.
    args = list(_plan_args())
    absent = next(n for n in range(30) if int(args[2][n]) < 0)
    args[0], args[2] = torch.tensor([absent]), args[2].clone()
    args[2][absent] = slot
    for fn in (OPS.cache_plan, cache_plan_reference):
        with pytest.raises(RuntimeError, match=rf"slot_of\[{absent}\]={slot} disagrees with pointer"):
            fn(*args)
        assert not args[1].any()
