"""The CUDA and Metal sparse_ffn and quantized_sparse_ffn bodies and the CUDA cache_compact bodies, run on the CPU
through the SIMT emulation (flashllm_ext._simt) against the pure-torch references. Small shapes: every emulated GPU
thread is an OS thread."""

import pytest
import torch

from flashllm_ext.ops import cache_compact_reference, quantized_sparse_ffn_reference, sparse_ffn_reference
from flashllm_ext.ops.blocks import BundleFormat
from tests.helpers.native import require_simt
from tests.helpers.ffn_cases import (
    FFN_DTYPES,
    assert_close,
    bad_ffn_cases,
    bad_quantized_ffn_cases,
    compact_state,
    ffn_case,
    quantized_case,
    random_compact_case,
)

require_simt()
OPS = torch.ops.flashllm_simt
BODIES = {"cuda": OPS.sparse_ffn_cuda, "metal": OPS.sparse_ffn_metal}
QUANTIZED_BODIES = {"cuda": OPS.quantized_sparse_ffn_cuda, "metal": OPS.quantized_sparse_ffn_metal}
INDEX = torch.tensor([30, 2, 2, 0, 17, 29, 8])


# (n_tok, d, capacity, num_used): d = 40 keeps 16-byte rows for every width (vector loads), 37 does not (scalar
# path); 9 tokens take two token groups; 1100 columns span several down-kernel column blocks.
@pytest.mark.parametrize("body", ["cuda", "metal"])
@pytest.mark.parametrize("dtype", FFN_DTYPES)
@pytest.mark.parametrize("glu,act", [(False, "relu"), (True, "silu"), (False, "gelu"), (True, "gelu_tanh")])
@pytest.mark.parametrize("shape", [(1, 40, 40, 31), (3, 37, 40, 31), (9, 16, 33, 33)])
def test_body_matches_reference(body, dtype, glu, act, shape):
    n_tok, d, capacity, num_used = shape
    x, m, b = ffn_case(n_tok, d, capacity, glu, dtype, seed=d + n_tok)
    cases = [({}, b), ({"index": INDEX, "threshold": 0.1}, b), ({"index": INDEX[:0]}, None)]
    for kwargs, bias in cases:
        want = sparse_ffn_reference(x, m, num_used, bias, act, glu, **kwargs)
        assert_close(BODIES[body](x, m, num_used, bias, act, glu, **kwargs), want)


@pytest.mark.parametrize("body", ["cuda", "metal"])
@pytest.mark.parametrize("shape", [(1100, 20), (8, 530)])
def test_body_wide_rows_and_many_chunks(body, shape):
    # 1100 fp16 columns: two column blocks of the down kernel; 530 rows: the 32-chunk cap, 17 rows per chunk.
    d, rows = shape
    x, m, b = ffn_case(2, d, rows, False, torch.float16, seed=7)
    assert_close(BODIES[body](x, m, rows, b, "relu", False), sparse_ffn_reference(x, m, rows, b, "relu", False))


@pytest.mark.parametrize("body", ["cuda", "metal"])
@pytest.mark.parametrize("glu,act", [(False, "relu"), (True, "relu"), (True, "silu")])
def test_body_a_nan_input_makes_its_token_nan(body, glu, act):
    # relu(NaN) is NaN, as torch's: a NaN is never turned into a zero that would pass as a result.
    x, m, b = ffn_case(2, 40, 12, glu, torch.float32, seed=4)
    x[1, 7] = float("nan")
    got, want = BODIES[body](x, m, 12, b, act, glu), sparse_ffn_reference(x, m, 12, b, act, glu)
    assert got[1].isnan().all() and want[1].isnan().all()
    assert_close(got[0], want[0])


@pytest.mark.parametrize("body", ["cuda", "metal"])
@pytest.mark.parametrize("case", bad_ffn_cases(), ids=lambda c: c[0][:30])
def test_body_bad_inputs(body, case):
    match, args, kwargs = case
    with pytest.raises(RuntimeError, match=match):
        BODIES[body](*args, **kwargs)


# (n_tok, d, capacity, num_used): d = 40 is two blocks, the second mostly padding; 9 tokens take two token groups.
@pytest.mark.parametrize("body", ["cuda", "metal"])
@pytest.mark.parametrize(
    "in_format,down_format", [("q8_0", "q8_0"), ("q4_0", "q8_0"), ("q4_1", "q4_1"), ("q4_0", "q4_0")]
)
@pytest.mark.parametrize("glu,act", [(False, "relu"), (True, "silu")])
@pytest.mark.parametrize("shape", [(1, 40, 40, 31), (9, 64, 33, 33)])
def test_quantized_body_matches_reference(body, in_format, down_format, glu, act, shape):
    n_tok, d, capacity, num_used = shape
    layout = BundleFormat(in_format, down_format)
    x, m, b = quantized_case(n_tok, d, capacity, glu, layout, seed=d + n_tok)
    cases = [({}, b), ({"index": INDEX.clamp(max=num_used - 1), "threshold": 0.1}, b), ({"index": INDEX[:0]}, None)]
    for kwargs, bias in cases:
        want = quantized_sparse_ffn_reference(x, m, num_used, bias, act, glu, layout.name, **kwargs)
        assert_close(QUANTIZED_BODIES[body](x, m, num_used, bias, act, glu, layout.name, **kwargs), want)


@pytest.mark.parametrize("body", ["cuda", "metal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantized_body_half_x_and_wide_rows(body, dtype):
    # 1100 columns: 35 blocks (a lane takes two) over two column blocks of the down kernel.
    layout = BundleFormat("q4_1", "q8_0")
    x, m, b = quantized_case(2, 1100, 6, True, layout, dtype, seed=11)
    want = quantized_sparse_ffn_reference(x, m, 5, b, "silu", True, layout.name)
    assert_close(QUANTIZED_BODIES[body](x, m, 5, b, "silu", True, layout.name), want)


@pytest.mark.parametrize("body", ["cuda", "metal"])
def test_quantized_body_many_chunks_and_a_nan_input(body):
    # 530 rows: the 32-chunk cap of the down kernel; a NaN in x makes its token's outputs NaN, as the reference's.
    layout = BundleFormat("q4_0", "q8_0")
    x, m, b = quantized_case(2, 32, 530, False, layout, seed=3)
    x[1, 20] = float("nan")
    want = quantized_sparse_ffn_reference(x, m, 530, b, "silu", False, layout.name)
    got = QUANTIZED_BODIES[body](x, m, 530, b, "silu", False, layout.name)
    assert got[1].isnan().all() and want[1].isnan().all()
    assert_close(got[0], want[0])


@pytest.mark.parametrize("body", ["cuda", "metal"])
@pytest.mark.parametrize("case", bad_quantized_ffn_cases(), ids=lambda c: c[0][:30])
def test_quantized_body_bad_inputs(body, case):
    match, args, kwargs = case
    with pytest.raises(RuntimeError, match=match):
        QUANTIZED_BODIES[body](*args, **kwargs)


def test_quantized_body_without_checks_skips_bad_index_entries():
    # What the CUDA glue does without kernel checks: entries outside [0, num_used) are never read and add nothing.
    layout = BundleFormat("q8_0", "q8_0")
    x, m, b = quantized_case(3, 64, 10, False, layout, seed=5)
    got = OPS.quantized_sparse_ffn_cuda(
        x, m, 6, b, "relu", False, layout.name, index=torch.tensor([0, 9, -4, 5]), check_data=False
    )
    want = quantized_sparse_ffn_reference(x, m, 6, b, "relu", False, layout.name, index=torch.tensor([0, 5]))
    assert_close(got, want)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("width,dtype", [(8, torch.float32), (5, torch.float16), (12, torch.int8)])
def test_cuda_compact_matches_reference(seed, width, dtype):
    # width x element size: 32 bytes (16-byte vector copies) or 10 and 12 (byte copies).
    state, num_used, rows = random_compact_case(seed, width, dtype)
    got = [t.clone() for t in state]
    want = [t.clone() for t in state]
    assert OPS.cache_compact_cuda(*got, num_used, rows) == cache_compact_reference(*want, num_used, rows)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_cuda_compact_bad_inputs():
    matrix, pointer, bias, slot_of = compact_state(10, 4, 6, 20, torch.float32, seed=0)
    for rows, match in (
        (torch.tensor([1, 1]), "twice"),
        (torch.tensor([6]), "outside"),
        (torch.tensor([-1]), "outside"),
    ):
        with pytest.raises(RuntimeError, match=match):
            OPS.cache_compact_cuda(matrix, pointer, bias, slot_of, 6, rows)


def test_cuda_body_without_checks_skips_bad_index_entries():
    # What the CUDA glue does without kernel checks: entries outside [0, num_used) contribute nothing.
    x, m, b = ffn_case(3, 40, 40, True, torch.float32, seed=3)
    index = torch.tensor([30, 31, 2, -1, 39, 0, 1 << 40])
    good = (index >= 0) & (index < 31)
    got = OPS.sparse_ffn_cuda(x, m, 31, b, "silu", True, index=index, check_data=False)
    assert_close(got, sparse_ffn_reference(x, m, 31, b, "silu", True, index=index[good]))
    with pytest.raises(RuntimeError, match=r"index\[1\]=31 is outside"):
        OPS.sparse_ffn_cuda(x, m, 31, b, "silu", True, index=index)


def guarded(t: torch.Tensor, pad: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """t copied into the middle of a buffer of sentinels (a copy of t's first dimension `pad` longer on both sides),
    and that buffer: a kernel writing outside t changes a sentinel."""
    buf = torch.full((t.shape[0] + 2 * pad, *t.shape[1:]), 77, dtype=t.dtype)
    view = buf[pad : pad + t.shape[0]]
    view.copy_(t)
    return view, buf


@pytest.mark.parametrize("rows", [[1, 1, 4], [6, 2], [-1, 0], [5, 5, 5, 5, 5, 5], [-3, 9, 2, 2, 0]])
def test_cuda_compact_without_checks_stays_in_bounds(rows):
    # Unchecked rows leave the cache state unspecified, but nothing outside the tensors is written.
    state = compact_state(10, 4, 6, 20, torch.float32, seed=0)
    state[1][2] = 99  # pointer row 2 names a neuron outside slot_of
    views, bufs = zip(*(guarded(t) for t in state))
    sentinels = [torch.cat([buf[:64].flatten(), buf[-64:].flatten()]) for buf in bufs]
    assert OPS.cache_compact_cuda(*views, 6, torch.tensor(rows), check_data=False) == 6 - len(rows)
    for buf, sentinel in zip(bufs, sentinels):
        assert torch.equal(torch.cat([buf[:64].flatten(), buf[-64:].flatten()]), sentinel)


def test_cuda_compact_refuses_more_rows_than_used_without_checks():
    state = compact_state(10, 4, 6, 20, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="rows holds 7 entries but only num_used=6"):
        OPS.cache_compact_cuda(*state, 6, torch.tensor([0, 1, 2, 3, 4, 5, 0]), check_data=False)


@pytest.mark.parametrize("seed", range(4))
def test_cuda_compact_without_checks_matches_reference_on_good_rows(seed):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(12, generator=g)[:5]
    got = compact_state(16, 8, 12, 40, torch.float32, seed)
    want = [t.clone() for t in got]
    assert OPS.cache_compact_cuda(*got, 12, rows, check_data=False) == cache_compact_reference(*want, 12, rows)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
