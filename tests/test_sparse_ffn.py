"""flashllm::sparse_ffn, cache_compact and cache_plan on the CPU: native kernels (every ISA path) against the
pure-torch references and dense math; opcheck; bad inputs; the default model's real FFN weights (slow).
The CUDA and Metal bodies are tested in test_ffn_simt.py."""
import pytest
import torch
import torch.nn.functional as F

import flashllm_ext  # noqa: F401
from flashllm_ext._ops import (cache_compact_reference, cache_plan_reference, compaction_moves,
                               sparse_ffn_reference)
from conftest import cpu_isas, forced_isa_fixture
from ffn_cases import FFN_DTYPES, assert_close, bad_ffn_cases, compact_state, ffn_case

OPS = torch.ops.flashllm


isa = forced_isa_fixture(cpu_isas(highest="avx512"))  # sparse_ffn has no VBMI2-specific path


def dense_ffn(x, up, down, gate, bias, act):
    """Plain dense MLP in float32: up/gate [n, d] (nn.Linear weights), down [d, n]."""
    xf = x.float()
    pre = xf @ (gate if gate is not None else up).float().t()
    if bias is not None:
        pre = pre + bias.float()
    h = {"relu": F.relu, "silu": F.silu, "gelu": F.gelu}[act](pre)
    if gate is not None:
        h = h * (xf @ up.float().t())
    return h @ down.float().t()


@pytest.mark.parametrize("dtype", FFN_DTYPES)
@pytest.mark.parametrize("glu,act", [(False, "relu"), (True, "silu"), (False, "gelu"), (True, "gelu")])
@pytest.mark.parametrize("n_tok", [1, 2, 3, 4, 5, 6, 7, 8, 11])
def test_native_matches_reference(isa, dtype, glu, act, n_tok):
    d, capacity, num_used = 37, 50, 41  # d: a 16-element loop plus a tail on every ISA
    x, m, b = ffn_case(n_tok, d, capacity, glu, dtype, seed=n_tok)
    index = torch.tensor([40, 3, 3, 0, 17, 22, 39, 8])  # any order, repeats count twice
    for kwargs in ({}, {"index": index}, {"threshold": 0.2}, {"index": index, "threshold": 0.05}):
        for bias in (b, None):
            want = sparse_ffn_reference(x, m, num_used, bias, act, glu, **kwargs)
            assert_close(OPS.sparse_ffn(x, m, num_used, bias, act, glu, **kwargs), want)


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 7, 13), (3, 16, 1), (2, 64, 0), (8, 130, 5)])
def test_odd_shapes(isa, shape):
    n_tok, d, capacity = shape
    for glu in (False, True):
        x, m, b = ffn_case(n_tok, d, max(capacity, 1), glu, torch.float32)
        m, b = m[:capacity], b[:capacity]
        for num_used in {0, capacity}:
            assert_close(OPS.sparse_ffn(x, m, num_used, b, "silu", glu),
                         sparse_ffn_reference(x, m, num_used, b, "silu", glu))
    empty = torch.empty(0, dtype=torch.int64)
    assert torch.equal(OPS.sparse_ffn(x, m, capacity, b, "relu", glu, empty), torch.zeros_like(x))


@pytest.mark.parametrize("dtype", FFN_DTYPES)
def test_parallel_path_and_dense_math(isa, dtype):
    # 600 rows x 3 x 256 x 2 bytes: past the 256 KiB below which the kernel stays on one thread.
    n, d = 600, 256
    g = torch.Generator().manual_seed(3)
    up, gate = (torch.randn(n, d, generator=g) / 16).to(dtype), (torch.randn(n, d, generator=g) / 16).to(dtype)
    down = (torch.randn(d, n, generator=g) / 16).to(dtype)
    x = torch.randn(4, d, generator=g).to(dtype)
    matrix = torch.cat([up, gate, down.t()], dim=1).contiguous()
    got = OPS.sparse_ffn(x, matrix, n, None, "silu", True)
    assert_close(got, dense_ffn(x, up, down, gate, None, "silu").to(dtype))


def test_non_contiguous_x_and_bias():
    x, m, b = ffn_case(4, 24, 30, False, torch.float32)
    xt = torch.randn(24, 4).t()
    bias = torch.randn(60)[::2]
    assert_close(OPS.sparse_ffn(xt, m, 30, bias, "relu", False), sparse_ffn_reference(xt, m, 30, bias, "relu", False))


def test_threshold_skips_small_activations():
    x, m, b = ffn_case(3, 16, 20, True, torch.float32, seed=5)
    full = OPS.sparse_ffn(x, m, 20, None, "silu", True)
    # A threshold above every |activation| skips everything; 0 skips nothing.
    assert torch.equal(OPS.sparse_ffn(x, m, 20, None, "silu", True, None, 1e9), torch.zeros_like(full))
    assert torch.equal(OPS.sparse_ffn(x, m, 20, None, "silu", True, None, 0.0), full)


def test_opcheck():
    x, m, b = ffn_case(3, 16, 12, True, torch.float32)
    torch.library.opcheck(OPS.sparse_ffn, (x, m, 10, b, "silu", True), {"index": torch.tensor([1, 4]),
                                                                     "threshold": 0.1})
    matrix, pointer, bias, slot_of = compact_state(12, 8, 9, 30, torch.float16, seed=1)
    # AOT dispatch cannot functionalize an in-place op that returns an int (torch refuses before running it): the
    # schema, autograd registration and fake kernel are checked.
    torch.library.opcheck(OPS.cache_compact, (matrix, pointer, bias, slot_of, 9, torch.tensor([2, 8, 0])),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("case", bad_ffn_cases(), ids=lambda c: c[0][:30])
def test_bad_inputs(case):
    match, args, kwargs = case
    for fn in (OPS.sparse_ffn, sparse_ffn_reference):
        with pytest.raises(RuntimeError, match=match):
            fn(*args, **kwargs)


# ------------------------------------------------------------------------------------------------ cache_compact
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
        kept = OPS.cache_compact(got[0], got[1], got[2] if with_bias else None, got[3] if with_slots else None,
                                 num_used, rows)
        ref = [t.clone() for t in want]
        assert kept == cache_compact_reference(ref[0], ref[1], ref[2] if with_bias else None,
                                               ref[3] if with_slots else None, num_used, rows)
        assert kept == num_used - c
        for a, b in zip(got, ref):
            assert torch.equal(a, b)
    survivors = set(state[1][:num_used].tolist()) - set(state[1][rows].tolist())
    assert set(got[1][:kept].tolist()) == survivors


def test_cache_compact_bad_inputs():
    matrix, pointer, bias, slot_of = compact_state(10, 4, 6, 20, torch.float32, seed=0)
    for fn in (OPS.cache_compact, cache_compact_reference):
        for rows, match in ((torch.tensor([1, 1]), "twice"), (torch.tensor([6]), "outside"),
                            (torch.tensor([-1]), "outside"), (torch.tensor([0.0]), "rows must be a 1-D int64")):
            with pytest.raises(RuntimeError, match=match):
                fn(matrix, pointer, bias, slot_of, 6, rows)
        with pytest.raises(RuntimeError, match="num_used=11 is outside"):
            fn(matrix, pointer, bias, slot_of, 11, torch.tensor([0]))
        with pytest.raises(RuntimeError, match="pointer must be int64"):
            fn(matrix, pointer[:5], bias, slot_of, 5, torch.tensor([0]))
        with pytest.raises(RuntimeError, match="bias must be 1-D"):
            fn(matrix, pointer, bias[:3], slot_of, 5, torch.tensor([0]))
    assert torch.equal(pointer[:6], compact_state(10, 4, 6, 20, torch.float32, seed=0)[1][:6])  # untouched


# ------------------------------------------------------------------------------------------------ cache_plan
@pytest.mark.parametrize("seed", range(20))
def test_cache_plan_matches_reference(seed):
    g = torch.Generator().manual_seed(seed)
    n, capacity, window = 40, int(torch.randint(8, 30, (1,), generator=g)), int(torch.randint(1, 4, (1,),
                                                                                              generator=g))
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
        outs.append((list(counts), last_c, sorted(evict[:w].tolist()), evict[w:w + b].sort().values,
                     sorted(missing[:m].tolist())))
    (c1, l1, e1, b1, m1), (c2, l2, e2, b2, m2) = outs
    assert c1 == c2 and torch.equal(l1, l2) and e1 == e2 and torch.equal(b1, b2) and m1 == m2


def test_cache_plan_refuses_too_many_active_and_changes_nothing():
    _, pointer, _, slot_of = compact_state(4, 1, 2, 10, torch.float32, seed=0)
    last = torch.zeros(10, dtype=torch.int64)
    for fn in (OPS.cache_plan, cache_plan_reference):
        with pytest.raises(RuntimeError, match="5 distinct active neurons but the cache holds 4"):
            fn(torch.tensor([0, 1, 2, 3, 4, 4]), last, slot_of, pointer, 2, 1, 2, torch.empty(4, dtype=torch.int64),
               torch.empty(4, dtype=torch.int64))
        with pytest.raises(RuntimeError, match="outside"):
            fn(torch.tensor([10]), last, slot_of, pointer, 2, 1, 2, torch.empty(4, dtype=torch.int64),
               torch.empty(4, dtype=torch.int64))
        assert not last.any()


# ------------------------------------------------------------------------------------------------ real weights
@pytest.mark.slow
def test_default_model_ffn_weights():
    """Layers of SmolLM2-135M (d=576, 1536 neurons, SwiGLU): sparse_ffn over all rows and over a random half,
    against dense math on the same weights, fp32 and bf16, T = 1 and 8."""
    from flashllm_ext.models import fetch_default, load_gguf
    from flashllm_ext.store import bundle_layer

    weights = load_gguf(fetch_default(), progress=False)
    g = torch.Generator().manual_seed(0)
    for layer in (0, 29):
        p = f"model.layers.{layer}.mlp."
        up, gate, down = (weights[p + k + ".weight"].float() for k in ("up_proj", "gate_proj", "down_proj"))
        for dtype in (torch.float32, torch.bfloat16):
            matrix = bundle_layer(up.to(dtype), down.to(dtype), gate.to(dtype))
            for n_tok in (1, 8):
                x = torch.randn(n_tok, up.shape[1], generator=g).to(dtype)
                want = dense_ffn(x, up.to(dtype), down.to(dtype), gate.to(dtype), None, "silu")
                got = OPS.sparse_ffn(x, matrix, matrix.shape[0], None, "silu", True)
                torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=2e-2 * want.abs().max().item())
                half = torch.randperm(matrix.shape[0], generator=g)[: matrix.shape[0] // 2]
                mask = torch.zeros(matrix.shape[0], dtype=torch.bool)
                mask[half] = True
                want_half = dense_ffn(x, up.to(dtype)[mask], down.to(dtype)[:, mask], gate.to(dtype)[mask], None,
                                      "silu")
                got_half = OPS.sparse_ffn(x, matrix, matrix.shape[0], None, "silu", True, half)
                torch.testing.assert_close(got_half.float(), want_half, rtol=1e-2,
                                           atol=2e-2 * want_half.abs().max().item())


@pytest.mark.parametrize("kernel", ["native", "reference"])
def test_threshold_tie_is_dropped_as_the_predictor_does(isa, kernel):
    # activation exactly equal to the threshold: inactive, as predictor.capture_activations (score > threshold)
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    row = torch.tensor([[0.5, 0, 0, 0, 1, 1, 1, 1], [0.75, 0, 0, 0, 1, 1, 1, 1]])  # [up | down], d=4
    fn = OPS.sparse_ffn if kernel == "native" else sparse_ffn_reference
    y = fn(x, row, 2, None, "relu", False, None, 0.5)
    assert torch.equal(y, torch.full((1, 4), 0.75))  # only the 0.75 row survives
