"""half_linear: y = x W^T (+ bias) for float16 / bfloat16 weights on the CPU.

Each op: schema, checks (worded as the native kernels word them, csrc/common/<op>_checks.h), pure-torch
reference kernel (registered as CompositeExplicitAutograd: every device without a native kernel, the test
oracle and the benchmark baseline), fake kernel, and the typed wrapper library code calls.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from flashllm_ext.ops.library import LIB
from flashllm_ext.ops.ffn import FFN_DTYPES


# ------------------------------------------------------------------------------------------------ half_linear
# y = x W^T + b with W (and b) stored in float16 / bfloat16 (float32 accepted), computed in float32 and returned in
# x's dtype: the resident linears of a flash-loaded model on the CPU (flashllm_ext/flash/half_linear.py), where PyTorch's fp16
# matmul falls behind once several tokens share a weight pass. CPU kernel only; elsewhere the reference.
LIB.define("half_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


def _check_half_linear_metadata(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """The checks of csrc/common/half_linear_checks.h."""
    torch._check(
        x.dtype in FFN_DTYPES and x.dim() == 2,
        lambda: (
            f"half_linear: x must be a 2-D float32/float16/bfloat16 tensor [T, d], got {x.dtype} of "
            f"shape {tuple(x.shape)}"
        ),
    )
    torch._check(
        weight.dtype in FFN_DTYPES and weight.dim() == 2 and weight.shape[1] == x.shape[1],
        lambda: (
            f"half_linear: weight must be a 2-D float32/float16/bfloat16 tensor [n, d={x.shape[1]}], "
            f"got {weight.dtype} of shape {tuple(weight.shape)}"
        ),
    )
    torch._check(
        bias is None or (bias.dtype == weight.dtype and bias.dim() == 1 and bias.shape[0] == weight.shape[0]),
        lambda: (
            f"half_linear: bias must be {weight.dtype} (the weight's dtype) of shape [n={weight.shape[0]}], "
            f"got {bias.dtype} of shape {tuple(bias.shape)}"
        ),
    )
    torch._check(
        weight.device == x.device and (bias is None or bias.device == x.device),
        lambda: (
            f"half_linear: weight and bias must be on x's device ({x.device}), got {weight.device}"
            + ("" if bias is None else f" and {bias.device}")
        ),
    )


def half_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Pure-torch half_linear: x [T, d], weight [n, d], bias [n] | None -> [T, n] of x.dtype, in float32."""
    _check_half_linear_metadata(x, weight, bias)
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


@torch.library.impl(LIB, "half_linear", "CompositeExplicitAutograd")
def _half_linear_default(x, weight, bias):
    return half_linear_reference(x, weight, bias)


@torch.library.register_fake("flashllm::half_linear")
def _half_linear_fake(x, weight, bias):
    _check_half_linear_metadata(x, weight, bias)
    return x.new_empty((x.shape[0], weight.shape[0]))


def half_linear(x: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x weight^T + bias, computed in float32 from float16 / bfloat16 (or float32) weights; the CPU kernel reads
    each weight row once per 8 tokens (the resident linears of flashllm_ext/flash/half_linear.py).

    x: [T, d] float32 | float16 | bfloat16
    weight: [n, d] float32 | float16 | bfloat16
    bias: [n] of weight's dtype, or None
    Returns [T, n] of x.dtype.
    """
    return torch.ops.flashllm.half_linear.default(x, weight, bias)
