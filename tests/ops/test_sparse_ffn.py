"""flashllm::sparse_ffn on the CPU: native kernel (every ISA path) against the pure-torch reference and dense
math; opcheck and the fake kernel; bad inputs; the default model's real FFN weights (slow).
The CUDA and Metal bodies are tested in test_ffn_simt.py."""

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flashllm_ext import ops
from flashllm_ext.ops import ACTIVATIONS, config_activation, sparse_ffn_reference
from tests.helpers.native import cpu_isas, forced_isa_fixture
from tests.helpers.ffn_cases import FFN_DTYPES, assert_close, bad_ffn_cases, ffn_case

OPS = torch.ops.flashllm


isa = forced_isa_fixture(cpu_isas(highest="avx512"))  # sparse_ffn has no VBMI2-specific path


def dense_ffn(x, up, down, gate, bias, act):
    """Plain dense MLP in float32: up/gate [n, d] (nn.Linear weights), down [d, n]."""
    xf = x.float()
    pre = xf @ (gate if gate is not None else up).float().t()
    if bias is not None:
        pre = pre + bias.float()
    h = ACTIVATIONS[act].fn(pre)
    if gate is not None:
        h = h * (xf @ up.float().t())
    return h @ down.float().t()


@pytest.mark.parametrize("dtype", FFN_DTYPES)
@pytest.mark.parametrize(
    "glu,act", [(False, "relu"), (True, "silu"), (False, "gelu"), (True, "gelu"), (True, "gelu_tanh")]
)
@pytest.mark.parametrize("n_tok", [1, 2, 3, 4, 5, 6, 7, 8, 11])
def test_native_matches_reference(isa, dtype, glu, act, n_tok):
    d, capacity, num_used = 37, 50, 41  # d: a 16-element loop plus a tail on every ISA
    x, m, b = ffn_case(n_tok, d, capacity, glu, dtype, seed=n_tok)
    index = torch.tensor([40, 3, 3, 0, 17, 22, 39, 8])  # any order, repeats count twice
    few = torch.tensor([40, 5, 5][n_tok % 2 :])  # 2 or 3 of 41 rows: put in order by comparison or by counting
    for kwargs in ({}, {"index": index}, {"index": few}, {"threshold": 0.2}, {"index": index, "threshold": 0.05}):
        for bias in (b, None):
            want = sparse_ffn_reference(x, m, num_used, bias, act, glu, **kwargs)
            assert_close(ops.sparse_ffn(x, m, num_used=num_used, activation=act, glu=glu, bias=bias, **kwargs), want)


@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 7, 13), (3, 16, 1), (2, 64, 0), (8, 130, 5)])
def test_odd_shapes(isa, shape):
    n_tok, d, capacity = shape
    for glu in (False, True):
        x, m, b = ffn_case(n_tok, d, max(capacity, 1), glu, torch.float32)
        m, b = m[:capacity], b[:capacity]
        for num_used in {0, capacity}:
            assert_close(
                ops.sparse_ffn(x, m, num_used=num_used, activation="silu", glu=glu, bias=b),
                sparse_ffn_reference(x, m, num_used, b, "silu", glu),
            )
    empty = torch.empty(0, dtype=torch.int64)
    assert torch.equal(
        ops.sparse_ffn(x, m, num_used=capacity, activation="relu", glu=glu, bias=b, index=empty), torch.zeros_like(x)
    )


@pytest.mark.parametrize("dtype", FFN_DTYPES)
def test_parallel_path_and_dense_math(isa, dtype):
    # 600 rows x 3 x 256 x 2 bytes: past the 256 KiB below which the kernel stays on one thread.
    n, d = 600, 256
    g = torch.Generator().manual_seed(3)
    up, gate = (torch.randn(n, d, generator=g) / 16).to(dtype), (torch.randn(n, d, generator=g) / 16).to(dtype)
    down = (torch.randn(d, n, generator=g) / 16).to(dtype)
    x = torch.randn(4, d, generator=g).to(dtype)
    matrix = torch.cat([up, gate, down.t()], dim=1).contiguous()
    got = ops.sparse_ffn(x, matrix, num_used=n, activation="silu", glu=True)
    assert_close(got, dense_ffn(x, up, down, gate, None, "silu").to(dtype))


def test_non_contiguous_x_and_bias():
    x, m, b = ffn_case(4, 24, 30, False, torch.float32)
    xt = torch.randn(24, 4).t()
    bias = torch.randn(60)[::2]
    assert_close(
        ops.sparse_ffn(xt, m, num_used=30, activation="relu", glu=False, bias=bias),
        sparse_ffn_reference(xt, m, 30, bias, "relu", False),
    )


def test_threshold_skips_small_glu_products(isa):
    d = 16
    x, m, _ = ffn_case(3, d, 20, True, torch.float32, seed=5)
    up, gate, down = m[:, :d], m[:, d : 2 * d], m[:, 2 * d :].t()
    h = F.silu(x @ gate.t()) * (x @ up.t())  # [T, 20]: the GLU product the threshold applies to
    for threshold in (0.0, h.abs().median().item(), 1e9):  # nothing, about half, everything skipped
        want = torch.where(h.abs() > threshold, h, 0.0) @ down.t()
        got = ops.sparse_ffn(x, m, num_used=20, activation="silu", glu=True, threshold=threshold)
        assert_close(got, want)
    assert torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("glu,act", [(False, "relu"), (True, "relu"), (True, "silu"), (False, "gelu_tanh")])
def test_a_nan_input_makes_its_token_nan_with_every_activation(isa, glu, act):
    # relu(NaN) is NaN, as torch's: a NaN is never turned into a zero that would pass as a result.
    x, m, b = ffn_case(2, 40, 12, glu, torch.float32, seed=4)
    x[1, 7] = float("nan")
    got, want = (
        ops.sparse_ffn(x, m, num_used=12, activation=act, glu=glu, bias=b),
        sparse_ffn_reference(x, m, 12, b, act, glu),
    )
    assert got[1].isnan().all() and want[1].isnan().all()
    assert_close(got[0], want[0])


def test_opcheck():
    x, m, b = ffn_case(3, 16, 12, True, torch.float32)
    torch.library.opcheck(
        OPS.sparse_ffn, (x, m, 10, b, "silu", True), {"index": torch.tensor([1, 4]), "threshold": 0.1}
    )


@pytest.mark.parametrize(
    "case", [c for c in bad_ffn_cases() if not c[0].startswith(r"index\[")], ids=lambda c: c[0][:30]
)
def test_fake_kernel_refuses_bad_metadata(case):
    # Every check but the index range (data) is made on meta tensors too, with the same words.
    match, args, kwargs = case
    meta = lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v  # noqa: E731
    with pytest.raises(RuntimeError, match=match):
        OPS.sparse_ffn(*map(meta, args), **{k: meta(v) for k, v in kwargs.items()})


@pytest.mark.parametrize("case", bad_ffn_cases(), ids=lambda c: c[0][:30])
def test_bad_inputs(case):
    match, args, kwargs = case
    for fn in (OPS.sparse_ffn, sparse_ffn_reference):
        with pytest.raises(RuntimeError, match=match):
            fn(*args, **kwargs)


# ------------------------------------------------------------------------------------------------ real weights
@pytest.mark.slow
def test_default_model_ffn_weights():
    """Layers of SmolLM2-135M (d=576, 1536 neurons, SwiGLU): sparse_ffn over all rows and over a random half,
    against dense math on the same weights, fp32 and bf16, T = 1 and 8."""
    from flashllm_ext.io.checkpoint import load_gguf
    from flashllm_ext.flash.convert import bundle_layer
    from flashllm_ext.hub import fetch_default

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
                got = ops.sparse_ffn(x, matrix, num_used=matrix.shape[0], activation="silu", glu=True)
                torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=2e-2 * want.abs().max().item())
                half = torch.randperm(matrix.shape[0], generator=g)[: matrix.shape[0] // 2]
                mask = torch.zeros(matrix.shape[0], dtype=torch.bool)
                mask[half] = True
                want_half = dense_ffn(
                    x, up.to(dtype)[mask], down.to(dtype)[:, mask], gate.to(dtype)[mask], None, "silu"
                )
                got_half = ops.sparse_ffn(x, matrix, num_used=matrix.shape[0], activation="silu", glu=True, index=half)
                torch.testing.assert_close(
                    got_half.float(), want_half, rtol=1e-2, atol=2e-2 * want_half.abs().max().item()
                )


@pytest.mark.parametrize("kernel", ["native", "reference"])
def test_threshold_tie_is_dropped_as_the_predictor_does(isa, kernel):
    # activation exactly equal to the threshold: inactive, as predictor.capture_activations (score > threshold)
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    row = torch.tensor([[0.5, 0, 0, 0, 1, 1, 1, 1], [0.75, 0, 0, 0, 1, 1, 1, 1]])  # [up | down], d=4
    fn = OPS.sparse_ffn if kernel == "native" else sparse_ffn_reference
    y = fn(x, row, 2, None, "relu", False, None, 0.5)
    assert torch.equal(y, torch.full((1, 4), 0.75))  # only the 0.75 row survives


def test_config_activation_reads_each_familys_field_and_refuses_the_rest():
    assert config_activation({"hidden_act": "silu"}) == "silu"  # Llama and most families
    assert config_activation({"activation_function": "relu"}) == "relu"  # OPT
    assert config_activation({"hidden_activation": "gelu_pytorch_tanh"}) == "gelu_tanh"  # Gemma
    with pytest.raises(ValueError, match="'gelu_fast' is not supported"):  # an approximation no kernel computes
        config_activation({"hidden_act": "gelu_fast"})
    with pytest.raises(ValueError, match="names no activation"):
        config_activation({"hidden_act": None})


def test_activation_codes_match_the_native_header():
    """ACTIVATIONS' codes are what the native and Metal kernels switch on (FfnActivation in the C header)."""
    header = (Path(__file__).parents[2] / "csrc/common/sparse_ffn_checks.h").read_text()
    codes = dict(re.findall(r"kAct(\w+) = (\d+)", header))
    snake = {re.sub(r"(?<!^)([A-Z])", r"_\1", k).lower(): int(v) for k, v in codes.items()}  # GeluTanh: gelu_tanh
    assert {name: spec.code for name, spec in ACTIVATIONS.items()} == snake
