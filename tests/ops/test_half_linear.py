"""flashllm::half_linear (y = x W^T + b from half-precision weights, in float32) on the CPU: native kernel against
the pure-torch reference over shapes, dtypes, biases and every CPU path; opcheck and the fake kernel; bad inputs;
the HalfLinear module that load_flash puts in place of the resident nn.Linear layers."""

import itertools

import pytest
import torch
from torch import nn

from flashllm_ext import ops
from flashllm_ext.ops import half_linear_reference
from flashllm_ext.flash.half_linear import HalfLinear, use_half_linears
from tests.helpers.native import cpu_isas, forced_isa_fixture

OPS = torch.ops.flashllm
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
isa = forced_isa_fixture(cpu_isas("avx512"))


def case(T: int, d: int, n: int, x_dtype: torch.dtype, w_dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g).to(x_dtype)
    w = (torch.randn(n, d, generator=g) / d**0.5).to(w_dtype)
    b = torch.randn(n, generator=g).to(w_dtype) if bias else None
    return x, w, b


def assert_close_to_reference(x, w, b) -> None:
    got, want = OPS.half_linear(x, w, b), half_linear_reference(x, w, b)
    assert got.dtype == x.dtype and got.shape == want.shape
    # float32 rounding of a length-d dot product (relative to the sum of |terms|), then the output dtype's rounding
    mag = x.float().abs() @ w.float().abs().t() + (0 if b is None else b.float().abs())
    eps = {torch.float32: 0.0, torch.float16: 2**-10, torch.bfloat16: 2**-7}[x.dtype]
    tol = mag * 1e-5 + want.float().abs() * eps + 1e-6
    assert bool(((got.float() - want.float()).abs() <= tol).all()), float(
        ((got.float() - want.float()).abs() - tol).max()
    )


@pytest.mark.parametrize(
    "T,d,n", [(1, 1, 1), (1, 576, 192), (7, 13, 5), (2, 31, 33), (8, 64, 9), (9, 100, 17), (17, 250, 3), (3, 4096, 2)]
)
@pytest.mark.parametrize("w_dtype", DTYPES)
def test_matches_reference_on_every_path(isa, T, d, n, w_dtype):
    for x_dtype, bias in itertools.product(DTYPES, (False, True)):
        assert_close_to_reference(*case(T, d, n, x_dtype, w_dtype, bias))


def test_threads_split_rows_of_a_large_weight(isa):
    assert_close_to_reference(*case(5, 1024, 700, torch.float16, torch.float16, True))  # >= 256 KiB: parallel rows


def test_non_contiguous_inputs_and_empty_shapes():
    x, w, b = case(4, 64, 24, torch.float16, torch.float16, True)
    assert_close_to_reference(x.t().contiguous().t(), w[:, ::1].t().contiguous().t(), b)
    assert_close_to_reference(torch.randn(4, 128).half()[:, ::2], w, b)
    assert_close_to_reference(x, w[::2], b[::2])
    assert OPS.half_linear(x[:0], w, b).shape == (0, 24)
    empty = OPS.half_linear(torch.zeros(3, 0).half(), torch.zeros(5, 0).half(), torch.ones(5).half())
    assert torch.equal(empty, torch.ones(3, 5).half())  # x W^T is an empty sum: the bias alone


def test_opcheck():
    for x_dtype, w_dtype, bias in (
        (torch.float32, torch.float16, True),
        (torch.float16, torch.float16, False),
        (torch.bfloat16, torch.bfloat16, True),
    ):
        x, w, b = case(3, 40, 12, x_dtype, w_dtype, bias)
        torch.library.opcheck(OPS.half_linear.default, (x, w, b))
        assert torch.equal(ops.half_linear(x, w, bias=b), OPS.half_linear(x, w, b))  # the wrapper: the op


@pytest.mark.parametrize(
    "args,message",
    [
        ((torch.randn(2, 3, 4), torch.randn(5, 4), None), "x must be a 2-D"),
        ((torch.randn(2, 4).int(), torch.randn(5, 4), None), "x must be a 2-D"),
        ((torch.randn(2, 4), torch.randn(5, 3).half(), None), r"weight must be a 2-D .* \[n, d=4\]"),
        ((torch.randn(2, 4), torch.randn(5, 4).double(), None), "weight must be"),
        ((torch.randn(2, 4), torch.randn(5, 4).half(), torch.randn(5)), "bias must be torch.float16|bias must be Half"),
        ((torch.randn(2, 4), torch.randn(5, 4).half(), torch.randn(4).half()), r"bias must be .* \[n=5\]"),
        ((torch.randn(2, 4), torch.randn(5, 4, device="meta").half(), None), "must be on x's device"),
    ],
)
def test_bad_inputs_raise_clearly(args, message):
    for fn in (OPS.half_linear, half_linear_reference):
        with pytest.raises(RuntimeError, match=message):
            fn(*args)


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16, bias=False)).half()
        self.head32 = nn.Linear(16, 4)  # float32: stays an nn.Linear

    def forward(self, x):
        return self.head32(self.inner(x).float())


def test_half_linear_module_matches_nn_linear_and_keeps_its_parameters():
    torch.manual_seed(0)
    model = TwoLinears()
    reference = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    x = torch.randn(2, 3, 32).half()
    want = model(x)
    assert use_half_linears(model) == 2
    assert [type(m) for m in model.modules() if isinstance(m, nn.Linear)] == [HalfLinear, HalfLinear, nn.Linear]
    assert [m.weight for m in model.modules() if isinstance(m, nn.Linear)] == reference  # the same Parameters
    got = model(x)
    assert got.shape == want.shape and torch.allclose(got, want, atol=2e-3, rtol=2e-3)
    assert use_half_linears(model) == 0  # already in place
