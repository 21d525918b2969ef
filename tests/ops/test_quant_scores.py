"""flashllm::quant_scores (the quant predictor's scores from low-bit rows) on the CPU: native kernel against the
pure-torch reference (round x to int8 per token, dequantise, then matmul) to float32 rounding over shapes, bits,
biases, gate and activations, on every CPU path; the int8 rounding of x is part of the contract on every path;
opcheck and the fake kernel; bad inputs; the predictor calls it."""

import itertools

import pytest
import torch

from flashllm_ext import ops
from flashllm_ext.ops import ACTIVATIONS, QUANT_MAX_COLUMNS, dequantize_rows, quant_scores_reference, round_x_int8
from flashllm_ext.predictor.quant import pack_codes
from tests.helpers.native import cpu_isas, forced_isa_fixture

OPS = torch.ops.flashllm
# The byte tables (scalar), the int16 decode into vpmaddwd (AVX2), the in-register decode into fp32 FMA (AVX-512) and
# the integer dot products (VNNI).
isa = forced_isa_fixture(cpu_isas(paths=("scalar", "avx2", "avx512", "avx512vnni", "avx512vbmi2")))


def quant_matrix(
    n: int, d: int, bits: int, g: torch.Generator, groups: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 1 << bits, (n, d), dtype=torch.uint8, generator=g)
    packed = pack_codes(codes, bits) if n else torch.zeros(0, -(-d * bits // 8), dtype=torch.uint8)
    padding = packed.shape[1] * 8 - d * bits
    if padding:  # garbage in the padding bits of the last byte must not count
        used = (1 << (8 - padding)) - 1  # the bits of the last byte's real codes
        packed[:, -1] |= torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) & (255 - used)
    shape = (n,) if groups is None else (n, groups)
    return packed, (torch.rand(shape, generator=g) * 0.1 + 0.01).half()


def case(
    T: int,
    d: int,
    n: int,
    up_bits: int,
    gate_bits: int | None,
    biases: bool,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    up_groups: int | None = None,
    gate_groups: int | None = None,
) -> tuple:
    """Positional args of the op: x, up_codes, up_scale, up_bias, gate_codes, gate_scale, gate_bias, bits...
    (*_groups: scales per group of d / groups columns; None: per row)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g).to(dtype)
    up_codes, up_scale = quant_matrix(n, d, up_bits, g, up_groups)
    up_bias = torch.randn(n, generator=g) if biases else None
    gate_codes = gate_scale = gate_bias = None
    if gate_bits is not None:
        gate_codes, gate_scale = quant_matrix(n, d, gate_bits, g, gate_groups)
        gate_bias = torch.randn(n, generator=g) if biases else None
    return (x, up_codes, up_scale, up_bias, gate_codes, gate_scale, gate_bias, up_bits, gate_bits or 4)


def assert_close_to_reference(args: tuple, activation: str) -> None:
    got = OPS.quant_scores(*args, activation)
    want = quant_scores_reference(*args, activation)
    assert got.dtype == torch.float32 and got.shape == want.shape
    # float32 rounding of a length-d dot product: relative to the sum of |terms| (the magnitude it rounds at)
    x, up_codes, up_scale, up_bias, gate_codes, gate_scale, gate_bias, up_bits, gate_bits = args
    d, x = x.shape[1], round_x_int8(x)  # what every path multiplies
    mag_up = x.abs() @ dequantize_rows(up_codes, up_scale, up_bits, d).abs().t()
    tol = 1.2 * (mag_up * 1e-5 + 1e-6)  # |act'| <= 1.2 for every activation
    if gate_codes is not None:
        mag_gate = x.abs() @ dequantize_rows(gate_codes, gate_scale, gate_bits, d).abs().t()
        up = (x @ dequantize_rows(up_codes, up_scale, up_bits, d).t()).abs() + mag_up * 1e-5
        tol = (mag_gate * 1e-5 + 1e-6) * 1.2 * (up + (up_bias.abs() if up_bias is not None else 0)) + (
            mag_gate + (gate_bias.abs() if gate_bias is not None else 0)
        ) * 1.2 * tol
    assert bool(((got - want).abs() <= tol).all()), float(((got - want).abs() - tol).max())


@pytest.mark.parametrize("T,d", [(1, 576), (1, 13), (2, 7), (3, 64), (5, 101), (8, 576), (9, 33), (17, 250)])
@pytest.mark.parametrize(
    "up_bits,gate_bits", [(2, 4), (1, 1), (4, 2), (2, None), (4, None), (1, None), (3, 4), (3, 3), (2, 3), (3, None)]
)
def test_matches_reference(isa, T, d, up_bits, gate_bits):
    for activation, biases in itertools.product(ACTIVATIONS, (False, True)):
        assert_close_to_reference(case(T, d, 37, up_bits, gate_bits, biases, seed=T * 1000 + d), activation)


# Widths around the VNNI path's steps (64 code bytes for 1, 2 and 4 bits: 512, 256, 128 columns; 24 bytes for 3 bits:
# 64 columns, read 32 bytes at a time) and its masked loads at a row's end.
@pytest.mark.parametrize("d", [63, 64, 65, 85, 86, 127, 128, 129, 255, 256, 257, 511, 512, 513, 1031])
@pytest.mark.parametrize("up_bits,gate_bits", [(1, None), (2, None), (3, None), (4, None), (3, 4), (2, 1)])
def test_chunk_boundaries(isa, d, up_bits, gate_bits):
    for T in (1, 3):
        assert_close_to_reference(case(T, d, 9, up_bits, gate_bits, True, seed=d * 10 + up_bits), "silu")


# Scales per group of d / G columns (a multiple of 64, so a group is whole bytes): groups that are whole VNNI steps
# (3 bits: 64 columns) and groups that end inside one (4 bits: 128 columns a step; 2 bits: 256), up and gate with their
# own group counts, one group given as [n, 1].
@pytest.mark.parametrize(
    "d,up_groups,gate_groups",
    [(576, 3, 3), (576, 9, 1), (576, None, 3), (576, 3, None), (192, 3, 1), (1024, 4, 16), (64, 1, 1)],
)
@pytest.mark.parametrize("up_bits,gate_bits", [(4, 3), (3, 4), (2, 1), (1, 2), (4, 4)])
def test_group_scales_match_reference(isa, d, up_groups, gate_groups, up_bits, gate_bits):
    for T, biases in ((1, False), (3, True), (8, True), (9, False)):
        args = case(T, d, 21, up_bits, gate_bits, biases, seed=T * 7 + d, up_groups=up_groups, gate_groups=gate_groups)
        assert_close_to_reference(args, "silu")


def test_one_group_equals_a_row_scale(isa):
    """[n, 1] scales are the per-row [n] scales: the same scores, bit for bit."""
    args = case(4, 576, 30, 3, 4, True, seed=5)
    x, up_codes, up_scale, up_bias, gate_codes, gate_scale, gate_bias, up_bits, gate_bits = args
    grouped = (x, up_codes, up_scale[:, None], up_bias, gate_codes, gate_scale[:, None], gate_bias, up_bits, gate_bits)
    torch.testing.assert_close(OPS.quant_scores(*grouped, "silu"), OPS.quant_scores(*args, "silu"), rtol=0, atol=0)


def test_x_is_rounded_to_int8_per_token(isa):
    """The contract, on every path: an entry below half a step of max|x| / 127 counts as zero, and a token's
    scale is its own (the second token is the first times 1000)."""
    x, uc, us, ub, gc, gs, gb, up_bits, gate_bits = case(1, 40, 12, 4, 2, True, seed=5)
    x = x / x.abs().max()
    x[0, 7] = 0.49 / 127  # rounds to 0
    x = torch.cat([x, x * 1000])
    zeroed = x.clone()
    zeroed[:, 7] = 0
    args = (uc, us, ub, gc, gs, gb, up_bits, gate_bits, "silu")
    got = OPS.quant_scores(x, *args)
    torch.testing.assert_close(got, OPS.quant_scores(zeroed, *args), rtol=1e-6, atol=0)
    torch.testing.assert_close(got, quant_scores_reference(x, *args), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_a_non_finite_token_scores_nan(isa, activation):
    """x rounded per token: an inf or NaN entry makes its token's every score NaN, as in the reference, and
    leaves the other tokens alone."""
    args = case(3, 70, 11, 3, 4, True, seed=9)
    x = args[0].clone()
    x[0, 5], x[2, 69] = float("inf"), float("nan")
    args = (x,) + args[1:]
    got, want = OPS.quant_scores(*args, activation), quant_scores_reference(*args, activation)
    assert bool(got[[0, 2]].isnan().all()) and bool(want[[0, 2]].isnan().all())
    alone = (x[1:2],) + args[1:]
    assert torch.equal(got[1:2], OPS.quant_scores(*alone, activation))
    assert_close_to_reference(alone, activation)


def test_integer_sums_do_not_overflow_at_the_largest_d(isa):
    """d = QUANT_MAX_COLUMNS, every code 15 and x all ones: 15 * 127 * d, the largest sum, fits in int32."""
    d = QUANT_MAX_COLUMNS
    codes = torch.full((1, d // 2), 255, dtype=torch.uint8)
    scale = torch.ones(1, dtype=torch.float16)
    got = OPS.quant_scores(torch.ones(1, d), codes, scale, None, None, None, None, 4, 4, "relu")
    assert float(got) == pytest.approx(7.5 * d, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_are_computed_in_float32(isa, dtype):
    assert_close_to_reference(case(4, 96, 50, 2, 4, True, dtype=dtype), "silu")


def test_empty_shapes(isa):
    assert OPS.quant_scores(*case(0, 16, 5, 2, 4, False), "silu").shape == (0, 5)
    assert OPS.quant_scores(*case(3, 16, 0, 2, 4, False), "silu").shape == (3, 0)
    assert OPS.quant_scores(*case(2, 0, 4, 2, 4, True), "relu").shape == (2, 4)


def test_wrapper_passes_arguments_by_name():
    x, uc, us, ub, gc, gs, gb, up_bits, gate_bits = args = case(2, 40, 9, 2, 4, True)
    got = ops.quant_scores(
        x,
        uc,
        us,
        up_bits=up_bits,
        up_bias=ub,
        gate_codes=gc,
        gate_scale=gs,
        gate_bits=gate_bits,
        gate_bias=gb,
        activation="gelu",
    )
    torch.testing.assert_close(got, quant_scores_reference(*args, "gelu"), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gate_bits", [4, None])
def test_opcheck(gate_bits):
    torch.library.opcheck(OPS.quant_scores.default, case(3, 21, 11, 2, gate_bits, True) + ("silu",))


def test_reference_keeps_to_the_inputs_device():
    # The reference is the kernel of every device without a native one (CUDA included): a constant it makes on the
    # CPU fails there. The meta device finds such a constant on a machine without a GPU.
    args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in case(3, 24, 10, 3, 4, True))
    out = quant_scores_reference(*args, "silu")
    assert out.device.type == "meta" and out.shape == (3, 10)


def test_fake_kernel_gives_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in case(6, 30, 17, 2, 4, True))
        out = OPS.quant_scores(*args, "silu")
    assert out.shape == (6, 17) and out.dtype == torch.float32


def _replace(args: tuple, **changes) -> tuple:
    names = ("x", "up_codes", "up_scale", "up_bias", "gate_codes", "gate_scale", "gate_bias", "up_bits", "gate_bits")
    return tuple(changes.get(name, a) for name, a in zip(names, args))


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"up_bits": 5}, "up_bits must be 1, 2, 3 or 4"),
        ({"gate_bits": 8}, "gate_bits must be 1, 2, 3 or 4"),
        ({"x": torch.zeros(2, 30, dtype=torch.int32)}, "x must be a 2-D float32/float16/bfloat16"),
        ({"x": torch.zeros(30)}, "x must be a 2-D"),
        ({"x": torch.zeros(1, QUANT_MAX_COLUMNS + 1)}, r"x has d=1048577 columns, at most 1048576"),
        ({"x": torch.zeros(2, 33)}, r"up_codes must be uint8 of shape \[n=17, ceil\(d=33 \* 2 / 8\)=9\]"),
        ({"up_codes": torch.zeros(17, 8, dtype=torch.int8)}, "up_codes must be uint8"),
        ({"up_scale": torch.zeros(17)}, "up_scale must be float16"),
        ({"up_scale": torch.zeros(17, 1, 1, dtype=torch.float16)}, "up_scale must be float16 of shape"),
        (
            {"up_scale": torch.zeros(17, 1, dtype=torch.float16)},
            "up_scale has 1 groups per row: d=30 must split into groups of a multiple of 64 columns",
        ),
        (
            {
                "x": torch.zeros(2, 128),
                "up_codes": torch.zeros(17, 32, dtype=torch.uint8),
                "gate_codes": torch.zeros(17, 64, dtype=torch.uint8),
                "gate_scale": torch.zeros(17, 3, dtype=torch.float16),
            },
            "gate_scale has 3 groups per row: d=128 must split",
        ),
        (
            {
                "x": torch.zeros(2, 128),
                "up_codes": torch.zeros(17, 32, dtype=torch.uint8),
                "gate_codes": torch.zeros(17, 64, dtype=torch.uint8),
                "gate_scale": torch.zeros(17, 4, dtype=torch.float16),
            },
            "gate_scale has 4 groups per row: d=128 must split into groups of a multiple of 64",
        ),
        ({"up_bias": torch.zeros(16)}, r"up_bias must be float32 of shape \[n=17\]"),
        ({"gate_bias": torch.zeros(17, dtype=torch.float16)}, "gate_bias must be float32"),
        ({"gate_codes": torch.zeros(17, 14, dtype=torch.uint8)}, "gate_codes must be uint8 of shape"),
        ({"gate_scale": None}, "gate_codes and gate_scale come together"),
        ({"gate_codes": None, "gate_scale": None}, "gate_bias needs gate_codes"),
    ],
)
def test_bad_inputs_are_refused(changes, message):
    args = _replace(case(2, 30, 17, 2, 4, True), **changes)
    for fn in (OPS.quant_scores, quant_scores_reference):
        with pytest.raises(RuntimeError, match=message):
            fn(*args, "silu")


def test_bad_activation_is_refused():
    for fn in (OPS.quant_scores, quant_scores_reference):
        with pytest.raises(RuntimeError, match="quant_scores: activation must be one of"):
            fn(*case(2, 30, 17, 2, 4, True), "tanh")


def test_predictor_scores_through_the_op():
    from flashllm_ext.predictor.quant import QuantPredictor

    p = QuantPredictor(2, 24, 10, "silu", True, gate_bits=4, up_bits=2, gate_bias=True, up_bias=True)
    g = torch.Generator().manual_seed(3)
    for layer in p.layers:
        for buf in layer.buffers():
            buf.copy_(
                torch.randint(0, 256, buf.shape, generator=g)
                if buf.dtype == torch.uint8
                else torch.rand(buf.shape, generator=g) * 0.1
            )
    x = torch.randn(3, 24, generator=g)
    q = p.layers[1]
    want = quant_scores_reference(
        x, q.up_codes, q.up_scale, q.up_bias, q.gate_codes, q.gate_scale, q.gate_bias, 2, 4, "silu"
    )
    torch.testing.assert_close(p.scores(1, x), want, rtol=1e-5, atol=1e-6)
