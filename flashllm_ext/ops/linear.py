"""half_linear: y = x W^T (+ bias) for float16 / bfloat16 weights on the CPU; quantized_linear: the same for weights
in GGUF blocks.

Each op: schema, checks (worded as the native kernels word them, csrc/common/<op>_checks.h), pure-torch
reference kernel (registered as CompositeExplicitAutograd: every device without a native kernel, the test
oracle and the benchmark baseline), fake kernel, and the typed wrapper library code calls.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from flashllm_ext.ops.blocks import BLOCK_FORMATS, QuantizedWeight, dequantize_rows, quantize_x_blocks
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


# ------------------------------------------------------------------------------------------------ quantized_linear
# y = x W^T (+ b) with W's rows in GGUF blocks of `weight_format` (q8_0, q4_0, q4_1: flashllm_ext/ops/blocks.py), x
# quantized per block of 32 columns first as quantized_sparse_ffn quantizes it, so each row's dot product is integer
# sums per block: the resident linears (attention, LM head) of a quantized store, in the bytes its file had; an
# offload store's layers in q8 / q4. Kernels: CPU and CUDA; elsewhere the reference.
LIB.define("quantized_linear(Tensor x, Tensor weight, str weight_format, Tensor? bias) -> Tensor")


def _check_quantized_linear_metadata(
    x: torch.Tensor, weight: torch.Tensor, weight_format: str, bias: torch.Tensor | None
) -> None:
    """The checks of csrc/common/quantized_linear_checks.h."""
    op = "quantized_linear"
    torch._check(
        x.dtype in FFN_DTYPES and x.dim() == 2,
        lambda: (
            f"{op}: x must be a 2-D float32/float16/bfloat16 tensor [T, d], got {x.dtype} of shape {tuple(x.shape)}"
        ),
    )
    torch._check(
        weight_format in BLOCK_FORMATS,
        lambda: f"{op}: weight_format must be one of {tuple(BLOCK_FORMATS)}, got {weight_format!r}",
    )
    width = BLOCK_FORMATS[weight_format].row_bytes(x.shape[1])
    torch._check(
        weight.dtype == torch.uint8 and weight.dim() == 2 and weight.shape[1] == width and weight.is_contiguous(),
        lambda: (
            f"{op}: weight must be contiguous uint8 of shape [n, {width}] ({weight_format} rows of d={x.shape[1]}), "
            f"got {weight.dtype} of shape {tuple(weight.shape)}"
        ),
    )
    torch._check(
        bias is None or (bias.dtype == x.dtype and bias.dim() == 1 and bias.shape[0] == weight.shape[0]),
        lambda: (
            f"{op}: bias must be {x.dtype} (x's dtype) of shape [n={weight.shape[0]}], got {bias.dtype} of shape "
            f"{tuple(bias.shape)}"
        ),
    )
    torch._check(
        weight.device == x.device and (bias is None or bias.device == x.device),
        lambda: (
            f"{op}: weight and bias must be on x's device ({x.device}), got {weight.device}"
            + ("" if bias is None else f" and {bias.device}")
        ),
    )


def quantized_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_format: str, bias: torch.Tensor | None
) -> torch.Tensor:
    """Pure-torch quantized_linear in float32: W dequantized, x rounded per block as the kernel rounds it.
    x [T, d], weight uint8 [n, row bytes] -> [T, n] of x.dtype."""
    _check_quantized_linear_metadata(x, weight, weight_format, bias)
    d = x.shape[1]
    codes, scale = quantize_x_blocks(x)
    x_rounded = (codes.float() * scale.unsqueeze(-1)).reshape(x.shape[0], -1)[:, :d]
    w = dequantize_rows(weight, weight_format, d)
    return F.linear(x_rounded, w, None if bias is None else bias.float()).to(x.dtype)


@torch.library.impl(LIB, "quantized_linear", "CompositeExplicitAutograd")
def _quantized_linear_default(x, weight, weight_format, bias):
    return quantized_linear_reference(x, weight, weight_format, bias)


@torch.library.register_fake("flashllm::quantized_linear")
def _quantized_linear_fake(x, weight, weight_format, bias):
    _check_quantized_linear_metadata(x, weight, weight_format, bias)
    return x.new_empty((x.shape[0], weight.shape[0]))


def quantized_linear(
    x: torch.Tensor, weight: torch.Tensor, *, weight_format: str, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """y = x weight^T + bias with weight's rows in GGUF blocks (integer dot products per block, float32 accumulation).

    x: [T, d] float32 | float16 | bfloat16
    weight: uint8 [n, BLOCK_FORMATS[weight_format].row_bytes(d)], contiguous
    weight_format: "q8_0" | "q4_0" | "q4_1"
    bias: [n] of x's dtype, or None
    Returns [T, n] of x.dtype.
    """
    return torch.ops.flashllm.quantized_linear.default(x, weight, weight_format, bias)


def quantized_matmul(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """quantized_linear over any leading dimensions: x [..., cols] by a QuantizedWeight [rows, cols] (+ bias [rows])
    -> [..., rows] of x's dtype."""
    rows, cols = weight.shape
    flat = x.reshape(-1, cols)
    y = quantized_linear(flat, weight.blocks, weight_format=weight.fmt, bias=bias)
    return y.reshape(*x.shape[:-1], rows)
