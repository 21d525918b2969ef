"""Inputs shared by every sparse_ffn / cache_compact / quantized_linear backend test (CPU kernel, reference,
SIMT-emulated CUDA and Metal bodies, MLX), so each sees the same problems and the same bad inputs."""

from __future__ import annotations

import torch

from flashllm_ext.ops.blocks import BundleFormat, quantize_rows

FFN_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Tolerance against the float32 reference: the kernels accumulate in float32 in another order, then round once.
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (1e-2, 1e-2), torch.bfloat16: (4e-2, 4e-2)}


def ffn_case(
    n_tok: int, d: int, capacity: int, glu: bool, dtype: torch.dtype, seed: int = 0, bias: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [T, d], matrix [capacity, 2d|3d], bias [capacity] of dtype, scaled so outputs are O(1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tok, d, generator=g).to(dtype)
    matrix = (torch.randn(capacity, (3 if glu else 2) * d, generator=g) / max(1.0, d**0.5)).to(dtype)
    b = (torch.randn(capacity, generator=g) * 0.5).to(dtype) if bias else None
    return x, matrix, b


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    rtol, atol = TOL[want.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


def bad_ffn_cases() -> list[tuple[str, tuple, dict]]:
    """(expected message, args, kwargs) that every sparse_ffn kernel must refuse."""
    x, m, b = ffn_case(2, 8, 10, False, torch.float32)
    return [
        ("x must be a 2-D", (x.long(), m, 5, b, "relu", False), {}),
        ("x must be a 2-D", (x[0], m, 5, b, "relu", False), {}),
        ("matrix must be", (x, m.half(), 5, b, "relu", False), {}),
        ("matrix must be", (x, m, 5, b, "silu", True), {}),  # a GLU bundle is 3d wide
        ("matrix must be contiguous", (x, m.t().contiguous().t(), 5, b, "relu", False), {}),
        ("num_used=11 is outside", (x, m, 11, b, "relu", False), {}),
        ("num_used=-1 is outside", (x, m, -1, b, "relu", False), {}),
        ("bias must be", (x, m, 5, b[:5], "relu", False), {}),
        ("bias must be", (x, m, 5, b.half(), "relu", False), {}),
        ("activation must be one of", (x, m, 5, b, "tanh", False), {}),
        ("threshold must be finite", (x, m, 5, b, "relu", False), {"threshold": -1.0}),
        ("threshold must be finite", (x, m, 5, b, "relu", False), {"threshold": float("nan")}),
        ("index must be a 1-D int64", (x, m, 5, b, "relu", False), {"index": torch.tensor([0, 1], dtype=torch.int32)}),
        (r"index\[1\]=5 is outside \[0, num_used=5\)", (x, m, 5, b, "relu", False), {"index": torch.tensor([0, 5])}),
        (r"index\[0\]=-1 is outside", (x, m, 5, b, "relu", False), {"index": torch.tensor([-1, 2])}),
    ]


def compact_state(capacity: int, width: int, num_used: int, n_neurons: int, dtype: torch.dtype, seed: int):
    """A consistent cache state: matrix, pointer (distinct neuron ids in rows < num_used, -1 after), bias, slot_of."""
    g = torch.Generator().manual_seed(seed)
    matrix = torch.randn(capacity, width, generator=g).to(dtype)
    pointer = torch.full((capacity,), -1, dtype=torch.int64)
    pointer[:num_used] = torch.randperm(n_neurons, generator=g)[:num_used]
    slot_of = torch.full((n_neurons,), -1, dtype=torch.int64)
    slot_of[pointer[:num_used]] = torch.arange(num_used)
    bias = torch.randn(capacity, generator=g).to(dtype)
    return matrix, pointer, bias, slot_of


def random_compact_case(seed: int, width: int, dtype: torch.dtype, max_capacity: int = 30, n_neurons: int = 50):
    """A random consistent cache state of random capacity (< max_capacity) and fill, and distinct rows to evict:
    ([matrix of dtype, pointer, bias, slot_of], num_used, rows)."""
    g = torch.Generator().manual_seed(seed)
    capacity = int(torch.randint(1, max_capacity, (1,), generator=g))
    num_used = int(torch.randint(0, capacity + 1, (1,), generator=g))
    rows = torch.randperm(num_used, generator=g)[: int(torch.randint(0, num_used + 1, (1,), generator=g))]
    matrix, pointer, bias, slot_of = compact_state(capacity, width, num_used, n_neurons, torch.float32, seed)
    return [matrix.to(dtype), pointer, bias, slot_of], num_used, rows


def quantized_case(n_tok, d, capacity, glu, layout, dtype=torch.float32, seed=0, bias=True):
    """x [T, d], quantized bundles uint8 [capacity, row bytes] and bias, from ffn_case's float weights."""
    x, m, b = ffn_case(n_tok, d, capacity, glu, dtype, seed=seed, bias=bias)
    gate = m[:, d : 2 * d] if glu else None
    return x, layout.quantize(m[:, :d], m[:, -d:].t(), gate), b


def bad_quantized_ffn_cases() -> list[tuple[str, tuple, dict]]:
    """(message, quantized_sparse_ffn's positional arguments, keyword arguments) of inputs every implementation
    refuses with that RuntimeError message."""
    layout = BundleFormat("q4_0", "q8_0")
    x, m, b = quantized_case(2, 64, 10, False, layout)
    name = layout.name
    return [
        ("x must be a 2-D", (x.long(), m, 5, b, "relu", False, name), {}),
        ("bundle_format must be", (x, m, 5, b, "relu", False, "q4_0"), {}),
        ("bundle_format must be", (x, m, 5, b, "relu", False, "q4_0+q5_0"), {}),
        ("matrix must be uint8", (x, m.float(), 5, b, "relu", False, name), {}),
        ("matrix must be uint8", (x, m, 5, b, "silu", True, name), {}),  # a GLU row holds a gate too
        ("matrix must be uint8", (x, m, 5, b, "relu", False, "q8_0+q8_0"), {}),
        ("matrix must be contiguous", (x, m.t().contiguous().t(), 5, b, "relu", False, name), {}),
        ("num_used=11 is outside", (x, m, 11, b, "relu", False, name), {}),
        ("bias must be", (x, m, 5, b[:5], "relu", False, name), {}),
        ("activation must be one of", (x, m, 5, b, "tanh", False, name), {}),
        ("threshold must be finite", (x, m, 5, b, "relu", False, name), {"threshold": -1.0}),
        (
            "index must be a 1-D int64",
            (x, m, 5, b, "relu", False, name),
            {"index": torch.tensor([0], dtype=torch.int32)},
        ),
        (
            r"index\[1\]=5 is outside \[0, num_used=5\)",
            (x, m, 5, b, "relu", False, name),
            {"index": torch.tensor([0, 5])},
        ),
    ]


def quantized_linear_case(n_tok, d, n, fmt, dtype=torch.float32, seed=0):
    """x [T, d], weight rows quantized to `fmt` [n, row bytes] and a bias, seeded."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tok, d, generator=g).to(dtype)
    weight = quantize_rows(torch.randn(n, d, generator=g) / d**0.5, fmt)
    bias = torch.randn(n, generator=g).to(dtype)
    return x, weight, bias


def bad_quantized_linear_cases() -> list[tuple[str, tuple]]:
    x, w, b = quantized_linear_case(2, 64, 10, "q4_0")
    return [
        ("x must be a 2-D", (x.long(), w, "q4_0", b)),
        ("weight_format must be one of", (x, w, "q5_0", b)),
        ("weight must be contiguous uint8", (x, w, "q8_0", b)),
        ("weight must be contiguous uint8", (x, w.float(), "q4_0", b)),
        ("weight must be contiguous uint8", (x[:, :32], w, "q4_0", b)),
        ("bias must be", (x, w, "q4_0", b[:5])),
        ("bias must be", (x, w, "q4_0", b.half())),
    ]
