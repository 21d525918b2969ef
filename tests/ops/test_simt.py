"""The CPU SIMT emulation (csrc/simt) and the CUDA and Metal Endor kernel bodies run through it.

Emulator semantics are checked against scalar models of each intrinsic; the kernel bodies against the pure-torch
reference, bitwise. Shapes stay small: every emulated GPU thread is an OS thread.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashllm_ext.ops import endor_decompress_reference
from tests.helpers.native import require_simt
from tests.helpers.kernel_cases import BAD_CASES, DTYPES, SHAPES, assert_bitwise_equal, endor_case

require_simt()
OPS = torch.ops.flashllm_simt
FULL = 0xFFFFFFFF
BODIES = {"cuda": OPS.endor_decompress_cuda, "metal": OPS.endor_decompress_metal}


def lane_inputs(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.float32:  # quarter-integers: sums are exact in any order
        return torch.randint(-400, 400, (n,), generator=gen).float() / 4
    return torch.randint(-(2**30), 2**30, (n,), generator=gen, dtype=torch.int64).to(dtype)


# ---- scalar models ----------------------------------------------------------------------------------------------


def model_cuda(name: str, x: list, param: list, mask: int, width: int) -> list:
    """What each thread of one block gets from a CUDA warp intrinsic; threads outside `mask` keep x."""
    out = list(x)
    for t in range(len(x)):
        lane, warp0 = t % 32, t - t % 32
        if not mask >> lane & 1:
            continue
        seg = lane - lane % width
        if name == "shfl":
            src = seg + param[t] % width
        elif name == "shfl_up":
            src = lane - param[t] if lane - param[t] >= seg else lane
        elif name == "shfl_down":
            src = lane + param[t] if lane + param[t] < seg + width else lane
        elif name == "shfl_xor":
            src = lane ^ param[t] if (lane ^ param[t]) < seg + width else lane
        elif name == "ballot":
            bits = sum(1 << l for l in range(32) if mask >> l & 1 and warp0 + l < len(x) and x[warp0 + l] != 0)
            out[t] = bits - (1 << 32) if bits >= 1 << 31 else bits  # int32 view of the unsigned word
            continue
        elif name == "popc":
            out[t] = bin(x[t] & 0xFFFFFFFF).count("1")
            continue
        elif name == "popcll":
            out[t] = bin(x[t] & 0xFFFFFFFFFFFFFFFF).count("1")
            continue
        elif name == "syncwarp":
            continue
        else:
            raise AssertionError(name)
        out[t] = x[warp0 + src]
    return out


def model_metal(name: str, x: list, param: list, grid: int, threadgroup: int) -> list:
    """What each of the first `grid` threads gets from a Metal SIMD-group function (others 0)."""
    out = [0] * len(x)
    for i in range(grid):
        group0 = i - i % threadgroup
        lane = (i - group0) % 32
        simd0 = i - lane
        lanes = [l for l in range(32) if simd0 + l < min(grid, group0 + threadgroup)]
        val = {l: x[simd0 + l] for l in lanes}
        if name == "simd_sum":
            out[i] = sum(val.values())
        elif name == "simd_max":
            out[i] = max(val.values())
        elif name == "simd_prefix_exclusive_sum":
            out[i] = sum(v for l, v in val.items() if l < lane)
        elif name == "simd_prefix_inclusive_sum":
            out[i] = sum(v for l, v in val.items() if l <= lane)
        elif name == "simd_shuffle":
            out[i] = val[param[i]]
        elif name == "simd_shuffle_up":
            out[i] = val[lane - param[i]] if lane - param[i] >= 0 else x[i]
        elif name == "simd_shuffle_down":
            out[i] = val[lane + param[i]] if lane + param[i] < 32 else x[i]
        elif name == "simd_shuffle_xor":
            out[i] = val[lane ^ param[i]]
        elif name == "simd_ballot":
            out[i] = sum(1 << l for l, v in val.items() if v != 0)
        elif name == "popcount":
            out[i] = bin(x[i] & 0xFFFFFFFF).count("1")
        else:
            raise AssertionError(name)
    return out


def wrap(values: list, dtype: torch.dtype) -> torch.Tensor:
    """Integer results as the tensor dtype would hold them (two's-complement wrap-around)."""
    if dtype == torch.float32:
        return torch.tensor(values, dtype=dtype)
    bits = torch.iinfo(dtype).bits
    return torch.tensor([(v + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1)) for v in values], dtype=dtype)


# ---- emulator: warp / SIMD intrinsics ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32])
@pytest.mark.parametrize("name", ["shfl", "shfl_up", "shfl_down", "shfl_xor"])
@pytest.mark.parametrize("width", [32, 8])
def test_cuda_shuffles_match_scalar_model(name, width, dtype):
    n = 96  # three warps
    x = lane_inputs(n, dtype, seed=1)
    gen = torch.Generator().manual_seed(2)
    param = torch.randint(0, 32 if name in ("shfl", "shfl_xor") else width, (n,), generator=gen)
    got = OPS.cuda_intrinsic(name, x, param, FULL, width)
    want = wrap(model_cuda(name, x.tolist(), param.tolist(), FULL, width), dtype)
    assert torch.equal(got, want)


@pytest.mark.parametrize("mask", [FULL, 0x0000FFFF, 0xA5A5A5A5])
def test_cuda_ballot_popc_syncwarp_match_scalar_model(mask):
    n = 64
    x = lane_inputs(n, torch.int32, seed=3)
    x[::3] = 0
    param = torch.zeros(n, dtype=torch.int64)
    for name in ("ballot", "popc", "popcll", "syncwarp"):
        xs = x.long() if name == "popcll" else x
        got = OPS.cuda_intrinsic(name, xs, param, mask, 32)
        assert torch.equal(got, wrap(model_cuda(name, xs.tolist(), param.tolist(), mask, 32), xs.dtype)), name


def test_cuda_partial_warp_takes_the_lanes_that_exist():
    # 40 threads: the second warp has 8 lanes; a full mask means those 8.
    x = lane_inputs(40, torch.int64, seed=4)
    param = torch.arange(40) % 8
    got = OPS.cuda_intrinsic("shfl", x, param, FULL, 32)
    assert torch.equal(got, wrap(model_cuda("shfl", x.tolist(), param.tolist(), FULL, 32), torch.int64))


@pytest.mark.parametrize("dtype", [torch.int32, torch.float32])
@pytest.mark.parametrize(
    "name",
    [
        "simd_sum",
        "simd_max",
        "simd_prefix_exclusive_sum",
        "simd_prefix_inclusive_sum",
        "simd_shuffle",
        "simd_shuffle_up",
        "simd_shuffle_down",
        "simd_shuffle_xor",
        "simd_ballot",
        "popcount",
    ],
)
def test_metal_simd_functions_match_scalar_model(name, dtype):
    if name == "popcount" and dtype == torch.float32:
        pytest.skip("popcount takes integers")
    grid, threadgroup = 100, 64  # the second threadgroup is cut to 36 threads: a simdgroup of 4 lanes
    x = lane_inputs(grid, dtype, seed=5)
    x[::5] = 0
    if name in ("simd_shuffle", "simd_shuffle_xor"):
        # a source lane inside each thread's own (possibly partial) simdgroup
        size = torch.tensor([min(32, grid - (i - i % 32)) for i in range(grid)])
        param = torch.randint(0, 32, (grid,), generator=torch.Generator().manual_seed(6)) % size
        if name == "simd_shuffle_xor":
            param = torch.where(size == 32, param, torch.zeros_like(param))
    else:
        param = torch.full((grid,), 3, dtype=torch.int64)
    if name in ("simd_shuffle_up", "simd_shuffle_down"):
        grid = 96  # full simdgroups: a shuffle reaching a missing lane is an error, tested below
    got = OPS.metal_intrinsic(name, x, param, grid, threadgroup)
    want = model_metal(name, x.tolist(), param.tolist(), grid, threadgroup)
    if name == "simd_ballot" and dtype == torch.int32:
        want = [w - (1 << 32) if w >= 1 << 31 else w for w in want]
    assert torch.equal(got, wrap(want, dtype))


def test_shuffle_from_a_missing_lane_is_reported():
    x, param = torch.arange(40, dtype=torch.int32), torch.full((40,), 2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="not taking part"):
        OPS.metal_intrinsic("simd_shuffle_down", x, param, 36, 64)  # lanes 2-3 of the last simdgroup read 4, 5


# ---- emulator: barriers and block-shared memory -----------------------------------------------------------------


@pytest.mark.parametrize("metal", [False, True])
@pytest.mark.parametrize("n_threads,n_active", [(64, 64), (96, 50)])
def test_barrier_orders_shared_memory_per_block(metal, n_threads, n_active):
    n_blocks, rounds = 3, 3
    got = OPS.barrier_rounds(n_blocks, n_threads, n_active, rounds, metal)
    b, t, r = np.meshgrid(np.arange(n_blocks), np.arange(n_threads), np.arange(rounds), indexing="ij")
    want = np.where(t < n_active, b * 1_000_000 + r * 1000 + (t + 1) % n_active, -1)
    assert np.array_equal(got.numpy(), want)


@pytest.mark.parametrize(
    "what,message",
    [
        ("divergent_intrinsics", "warp divergence"),
        ("exit_in_mask", "exited"),
        ("barrier_in_divergent_warp", "waits for it|deadlock"),
        ("shuffle_outside_mask", "not taking part"),
        ("mask_without_caller", "does not name the calling lane"),
        ("misaligned_vector_store", "misaligned 16-byte vector store"),
        ("kernel_throws", "kernel threw: index 99 past the end"),
    ],
)
def test_misuse_fails_the_launch_with_a_reason(what, message):
    with pytest.raises(RuntimeError, match=message):
        OPS.misuse(what)


# ---- the Endor kernel bodies ------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_endor_body_matches_reference_bitwise(body, dtype, shape):
    w, e = endor_case(shape, dtype, seed=shape[0] * 1000 + shape[1])
    args = (e.values, e.bitmap, e.row_offsets, shape[1])
    assert_bitwise_equal(BODIES[body](*args), w)
    rows = torch.randint(0, shape[0], (2 * shape[0] + 1,), generator=torch.Generator().manual_seed(7))
    assert_bitwise_equal(BODIES[body](*args, rows), endor_decompress_reference(*args, rows))


@pytest.mark.parametrize("body", BODIES)
def test_endor_body_edge_inputs(body):
    op = BODIES[body]
    w, e = endor_case((7, 13), torch.float16, seed=8)
    args = (e.values, e.bitmap, e.row_offsets, 13)
    assert op(*args, torch.empty(0, dtype=torch.int64)).shape == (0, 13)
    for density in (0.0, 1.0):
        wd, ed = endor_case((4, 40), torch.float32, seed=9, density=density)
        assert_bitwise_equal(op(ed.values, ed.bitmap, ed.row_offsets, 40), wd)
    # Non-contiguous values (a strided view) are accepted.
    strided = torch.stack([e.values, e.values], 1)[:, 0]
    assert not strided.is_contiguous()
    assert_bitwise_equal(op(strided, *args[1:]), w)


@pytest.mark.parametrize("body", BODIES)
@pytest.mark.parametrize("case", BAD_CASES, ids=lambda case: case[0][:40])
def test_endor_body_refuses_bad_input(body, case):
    expected, args = case
    with pytest.raises(RuntimeError, match=expected):
        BODIES[body](*args)


@pytest.mark.parametrize("body", BODIES)
def test_endor_body_names_the_first_bad_row(body):
    _, e = endor_case((7, 13), torch.float32, seed=11)
    args = (e.values, e.bitmap, e.row_offsets.clone(), 13)
    args[2][3] += 1  # rows 2 and 3 disagree with their popcounts
    with pytest.raises(RuntimeError, match=r"row 2: row_offsets says \d+ values but the bitmap has \d+ set bits"):
        BODIES[body](*args)
    with pytest.raises(RuntimeError, match=r"row 3: row_offsets says"):  # output row 1 is source row 3
        BODIES[body](*args, torch.tensor([6, 3, 2]))
    with pytest.raises(RuntimeError, match=r"rows\[1\]=7 is outside \[0, 7\)"):
        BODIES[body](*args[:2], e.row_offsets, 13, torch.tensor([0, 7, 9]))


def test_cuda_launcher_without_checks_zeroes_refused_rows():
    # What the CUDA glue does without kernel checks: no error, refused rows come out as zeros, the others decoded.
    w, e = endor_case((7, 13), torch.float32, seed=11)
    offsets = e.row_offsets.clone()
    offsets[3] += 1  # rows 2 and 3 disagree with their popcounts
    rows = torch.tensor([0, 7, 2, -1, 6, 3])
    got = OPS.endor_decompress_cuda(e.values, e.bitmap, offsets, 13, rows, check_data=False)
    refused = torch.tensor([False, True, True, True, False, True])
    assert torch.equal(got[refused], torch.zeros(4, 13))
    assert_bitwise_equal(got[~refused], w[rows[~refused]])
    with pytest.raises(RuntimeError, match=r"rows\[1\]=7 is outside"):
        OPS.endor_decompress_cuda(e.values, e.bitmap, offsets, 13, rows)


def test_cuda_launcher_never_reads_past_values_for_a_row_with_extra_bits():
    # The last row's bitmap marks more values than remain in `values`: the walk reads none past the end (ASan, under
    # make sanitize, sees the exactly sized clone) and the row comes out as zeros.
    w, e = endor_case((5, 40), torch.float16, seed=3)
    bitmap = e.bitmap.clone()
    bitmap[4] = 0xFF
    got = OPS.endor_decompress_cuda(e.values.clone(), bitmap, e.row_offsets, 40, None, check_data=False)
    assert torch.equal(got[4], torch.zeros(40, dtype=torch.float16))
    assert_bitwise_equal(got[:4], w[:4])
    with pytest.raises(RuntimeError, match=r"row 4: row_offsets says \d+ values but the bitmap has 40 set bits"):
        OPS.endor_decompress_cuda(e.values.clone(), bitmap, e.row_offsets, 40, None)


def test_import_alone_does_not_load_the_test_extension():
    # flashllm_ext._simt registers test-only ops; the package must not pull it in.
    import subprocess
    import sys

    code = "import sys, flashllm_ext; print('flashllm_ext._simt' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
