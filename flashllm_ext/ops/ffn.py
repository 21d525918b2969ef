"""sparse_ffn: the FFN of a token over the rows of a neuron-cache matrix (bundles up | gate | down).

Each op: schema, checks (worded as the native kernels word them, csrc/common/<op>_checks.h), pure-torch
reference kernel (registered as CompositeExplicitAutograd: every device without a native kernel, the test
oracle and the benchmark baseline), fake kernel, and the typed wrapper library code calls.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from flashllm_ext.ops.blocks import BLOCK_FORMATS, BundleFormat, quantize_x_blocks
from flashllm_ext.ops.library import LIB


# ------------------------------------------------------------------------------------------------ sparse_ffn
# y = sum over cached neuron rows i of h_i * down_i, where a row of `matrix` is one neuron's bundle
# [up_col | gate_col (GLU only) | down_row] (the flash store's layout, docs/design.md §5) and, per token,
#   non-GLU (OPT):   h_i = act(x . up_i + bias_i)
#   GLU (SwiGLU):    h_i = act(x . gate_i + bias_i) * (x . up_i)
# `bias` is the per-row bias of the input projection (OPT's fc1.bias), held by the neuron cache next to its rows
# so swap-delete moves it with them; the output projection's bias (fc2.bias) is one [d] vector added by the
# caller. Thresholded variant: a (token, row) term is kept only when |h_i| > threshold (the active-neuron rule of
# flashllm_ext.predictor: the GLU product for SwiGLU); threshold 0 skips only exact zeros, which contribute nothing.
LIB.define(
    "sparse_ffn(Tensor x, Tensor matrix, int num_used, Tensor? bias, str activation, bool glu, Tensor? index=None, "
    "float threshold=0.0) -> Tensor"
)

FFN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Activation(NamedTuple):
    """One activation of sparse_ffn."""

    code: int  # what the native and Metal kernels take: FfnActivation in csrc/common/sparse_ffn_checks.h
    fn: Callable[[torch.Tensor], torch.Tensor]  # exact float32 math, as the reference kernel computes it
    config_names: tuple[str, ...]  # Hugging Face config names (hidden_act / activation_function) meaning exactly it


# The one activation table. Only exact config names: tanh-approximated GELU variants would silently differ.
ACTIVATIONS = {
    "relu": Activation(0, torch.relu, ("relu",)),
    "silu": Activation(1, F.silu, ("silu", "swish")),
    "gelu": Activation(2, F.gelu, ("gelu",)),  # erf form
    # tanh-approximated GELU (Gemma's): gelu_new is the same formula written out
    "gelu_tanh": Activation(3, partial(F.gelu, approximate="tanh"), ("gelu_pytorch_tanh", "gelu_new")),
}
# The config fields that name the FFN's activation: Llama's and most families', OPT's, Gemma's.
ACTIVATION_FIELDS = ("hidden_act", "activation_function", "hidden_activation")


def config_activation(config: dict) -> str:
    """The ACTIVATIONS key of a Hugging Face config (a dict, or a config object's to_dict()); ValueError when the
    config names none or one no kernel computes exactly."""
    name = next((config[f] for f in ACTIVATION_FIELDS if config.get(f)), None)
    if name is None:
        raise ValueError(f"the model config names no activation (none of {', '.join(ACTIVATION_FIELDS)})")
    for activation, spec in ACTIVATIONS.items():
        if name in spec.config_names:
            return activation
    supported = sorted(n for spec in ACTIVATIONS.values() for n in spec.config_names)
    raise ValueError(f"activation {name!r} is not supported (one of {supported})")


def _check_ffn_x(op: str, x: torch.Tensor) -> int:
    """x [T, d] of a float dtype; returns d."""
    torch._check(
        x.dtype in FFN_DTYPES and x.dim() == 2,
        lambda: (
            f"{op}: x must be a 2-D float32/float16/bfloat16 tensor [T, d], got {x.dtype} of shape {tuple(x.shape)}"
        ),
    )
    return x.shape[1]


def _check_ffn_rows_args(
    op: str,
    x: torch.Tensor,
    matrix: torch.Tensor,
    width: int,
    num_used: int,
    bias: torch.Tensor | None,
    activation: str,
    index: torch.Tensor | None,
    threshold: float,
) -> None:
    """Every check but x's and the matrix's dtype and width (the op's own): the matrix is contiguous
    [capacity, width] (csrc/common/sparse_ffn_checks.h: check_ffn_rows_args, and the activation's)."""
    torch._check(
        matrix.stride(1) == 1 and (matrix.shape[0] <= 1 or matrix.stride(0) == width),
        lambda: f"{op}: matrix must be contiguous",
    )
    torch._check(
        0 <= num_used <= matrix.shape[0],
        lambda: f"{op}: num_used={num_used} is outside [0, capacity={matrix.shape[0]}]",
    )
    torch._check(
        activation in ACTIVATIONS,
        lambda: f"{op}: activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}",
    )
    torch._check(
        threshold >= 0 and threshold != float("inf"),  # NaN fails the first comparison
        lambda: f"{op}: threshold must be finite and >= 0, got {threshold}",
    )
    for name, t in (("matrix", matrix), ("bias", bias), ("index", index)):
        torch._check(t is None or t.device == x.device, lambda: f"{op}: {name} is on {t.device} but x is on {x.device}")
    torch._check(
        bias is None or (bias.dtype == x.dtype and bias.dim() == 1 and bias.shape[0] == matrix.shape[0]),
        lambda: (
            f"{op}: bias must be {x.dtype} of shape [capacity={matrix.shape[0]}], got "
            f"{bias.dtype} of shape {tuple(bias.shape)}"
        ),
    )
    torch._check(
        index is None or (index.dtype == torch.int64 and index.dim() == 1),
        lambda: f"{op}: index must be a 1-D int64 tensor, got {index.dtype} of shape {tuple(index.shape)}",
    )


def _check_index_range(op: str, index: torch.Tensor | None, num_used: int) -> None:
    """The data check the CPU kernels make as they go: every index entry in [0, num_used)."""
    if index is not None and index.numel():
        outside = (index < 0) | (index >= num_used)
        if bool(outside.any()):
            k = int(outside.nonzero()[0])
            raise RuntimeError(f"{op}: index[{k}]={int(index[k])} is outside [0, num_used={num_used})")


def _check_sparse_ffn_metadata(
    x: torch.Tensor,
    matrix: torch.Tensor,
    num_used: int,
    bias: torch.Tensor | None,
    activation: str,
    glu: bool,
    index: torch.Tensor | None,
    threshold: float,
) -> int:
    """The metadata checks of csrc/common/sparse_ffn_checks.h. Returns d (the hidden size)."""
    d = _check_ffn_x("sparse_ffn", x)
    width = (3 if glu else 2) * d
    torch._check(
        matrix.dtype == x.dtype and matrix.dim() == 2 and matrix.shape[1] == width,
        lambda: (
            f"sparse_ffn: matrix must be {x.dtype} of shape [capacity, {width}] ({'3' if glu else '2'} "
            f"x d={d}), got {matrix.dtype} of shape {tuple(matrix.shape)}"
        ),
    )
    _check_ffn_rows_args("sparse_ffn", x, matrix, width, num_used, bias, activation, index, threshold)
    return d


def check_sparse_ffn_args(
    x: torch.Tensor,
    matrix: torch.Tensor,
    num_used: int,
    bias: torch.Tensor | None,
    activation: str,
    glu: bool,
    index: torch.Tensor | None,
    threshold: float,
) -> int:
    """Every check the native kernels make, in torch (index range included). Returns d (the hidden size)."""
    d = _check_sparse_ffn_metadata(x, matrix, num_used, bias, activation, glu, index, threshold)
    _check_index_range("sparse_ffn", index, num_used)
    return d


def sparse_ffn_reference(
    x: torch.Tensor,
    matrix: torch.Tensor,
    num_used: int,
    bias: torch.Tensor | None,
    activation: str,
    glu: bool,
    index: torch.Tensor | None = None,
    threshold: float = 0.0,
) -> torch.Tensor:
    """Pure-torch sparse FFN in float32. x [T, d], matrix [capacity, 2d | 3d] -> [T, d] of x.dtype."""
    d = check_sparse_ffn_args(x, matrix, num_used, bias, activation, glu, index, threshold)
    rows = matrix[:num_used] if index is None else matrix[index]
    return _ffn_of_rows(x.float(), rows.float(), _row_bias(bias, num_used, index), d, activation, glu, threshold).to(
        x.dtype
    )


def _row_bias(bias: torch.Tensor | None, num_used: int, index: torch.Tensor | None) -> torch.Tensor | None:
    if bias is None:
        return None
    return (bias[:num_used] if index is None else bias[index]).float()


def _ffn_of_rows(
    xf: torch.Tensor,
    rows: torch.Tensor,
    row_bias: torch.Tensor | None,
    d: int,
    activation: str,
    glu: bool,
    threshold: float,
) -> torch.Tensor:
    """The reference math in float32: tokens xf [T, d] over float bundles rows [R, 2d | 3d] -> [T, d]."""
    first = rows[:, d : 2 * d] if glu else rows[:, :d]  # the column the activation applies to
    pre = xf @ first.t()
    if row_bias is not None:
        pre = pre + row_bias
    h = ACTIVATIONS[activation].fn(pre)
    if glu:
        h = h * (xf @ rows[:, :d].t())
    if threshold > 0:  # the active-neuron rule: |h| > threshold, h = act(...) (times x.up for GLU)
        h = torch.where(h.abs() <= threshold, torch.zeros((), dtype=h.dtype, device=h.device), h)  # NaN stays
    return h @ rows[:, -d:]


@torch.library.impl(LIB, "sparse_ffn", "CompositeExplicitAutograd")
def _sparse_ffn_default(x, matrix, num_used, bias, activation, glu, index=None, threshold=0.0):
    return sparse_ffn_reference(x, matrix, num_used, bias, activation, glu, index, threshold)


@torch.library.register_fake("flashllm::sparse_ffn")
def _sparse_ffn_fake(x, matrix, num_used, bias, activation, glu, index=None, threshold=0.0):
    _check_sparse_ffn_metadata(x, matrix, num_used, bias, activation, glu, index, threshold)
    return x.new_empty(x.shape)


def sparse_ffn(
    x: torch.Tensor,
    matrix: torch.Tensor,
    *,
    num_used: int,
    activation: str,
    glu: bool,
    bias: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
    threshold: float = 0.0,
) -> torch.Tensor:
    """The FFN of x over the neuron bundles in the rows of `matrix` (float32 accumulation).

    x: [T, d] float32 | float16 | bfloat16
    matrix: [C, 2d] (up | down) or, glu=True, [C, 3d] (up | gate | down), contiguous, x.dtype
    num_used: rows [0, num_used) are in use
    activation: "relu" | "silu" | "gelu" | "gelu_tanh" (flashllm_ext.ops.ACTIVATIONS); applied to x.up (x.gate with GLU) + bias
    bias: [C] of x.dtype, the input projection's bias of each row; None for none
    index: int64 [K] of rows < num_used (any order; a repeat counts twice); None for rows [0, num_used)
    threshold: a (token, row) term counts only when |h| > threshold; 0 skips only exact zeros
    Returns y: [T, d] of x.dtype, sum over the rows of h * down (h = act(...), times x.up with GLU).
    """
    return torch.ops.flashllm.sparse_ffn.default(x, matrix, num_used, bias, activation, glu, index, threshold)


# ------------------------------------------------------------------------------------------------ quantized_sparse_ffn
# sparse_ffn over bundle rows of GGUF blocks: a row of `matrix` (uint8) is [up | gate (GLU) | down], each ceil(d / 32)
# blocks of `bundle_format` "<in>+<down>" (flashllm_ext/ops/blocks.py: BundleFormat; the input columns in <in>, the
# down row in <down>, each of q8_0, q4_0, q4_1). Each token is quantized per block of 32 columns first (int8 codes
# with a float32 scale, ops.blocks.quantize_x_blocks), so the input columns' dot products are integer sums per block,
# as llama.cpp computes them; the down row is dequantized. bias and threshold as in sparse_ffn. Kernels: CPU and CUDA;
# elsewhere the reference.
LIB.define(
    "quantized_sparse_ffn(Tensor x, Tensor matrix, int num_used, Tensor? bias, str activation, bool glu, "
    "str bundle_format, Tensor? index=None, float threshold=0.0) -> Tensor"
)


def _parse_bundle_format(bundle_format: str) -> BundleFormat | None:
    try:
        return BundleFormat.parse(bundle_format)
    except ValueError:
        return None


def _check_quantized_sparse_ffn_metadata(
    x: torch.Tensor,
    matrix: torch.Tensor,
    num_used: int,
    bias: torch.Tensor | None,
    activation: str,
    glu: bool,
    bundle_format: str,
    index: torch.Tensor | None,
    threshold: float,
) -> tuple[int, BundleFormat]:
    """The metadata checks of csrc/common/quantized_ffn_checks.h. Returns d and the bundle layout."""
    op = "quantized_sparse_ffn"
    d = _check_ffn_x(op, x)
    layout = _parse_bundle_format(bundle_format)
    torch._check(
        layout is not None,
        lambda: (
            f"{op}: bundle_format must be '<in format>+<down format>' of {tuple(BLOCK_FORMATS)}, got {bundle_format!r}"
        ),
    )
    width = layout.row_bytes(d, glu)
    torch._check(
        matrix.dtype == torch.uint8 and matrix.dim() == 2 and matrix.shape[1] == width,
        lambda: (
            f"{op}: matrix must be uint8 of shape [capacity, {width}] ({bundle_format} bundles of d={d}, glu={glu}), "
            f"got {matrix.dtype} of shape {tuple(matrix.shape)}"
        ),
    )
    _check_ffn_rows_args(op, x, matrix, width, num_used, bias, activation, index, threshold)
    return d, layout


def quantized_sparse_ffn_reference(
    x: torch.Tensor,
    matrix: torch.Tensor,
    num_used: int,
    bias: torch.Tensor | None,
    activation: str,
    glu: bool,
    bundle_format: str,
    index: torch.Tensor | None = None,
    threshold: float = 0.0,
) -> torch.Tensor:
    """Pure-torch quantized sparse FFN in float32: the rows dequantized, x rounded per block as the kernels round it.
    x [T, d], matrix uint8 [capacity, row bytes] -> [T, d] of x.dtype."""
    d, layout = _check_quantized_sparse_ffn_metadata(
        x, matrix, num_used, bias, activation, glu, bundle_format, index, threshold
    )
    _check_index_range("quantized_sparse_ffn", index, num_used)
    rows = layout.dequantize(matrix[:num_used] if index is None else matrix[index], d, glu)
    codes, scale = quantize_x_blocks(x)
    x_rounded = (codes.float() * scale.unsqueeze(-1)).reshape(x.shape[0], -1)[:, :d]
    return _ffn_of_rows(x_rounded, rows, _row_bias(bias, num_used, index), d, activation, glu, threshold).to(x.dtype)


@torch.library.impl(LIB, "quantized_sparse_ffn", "CompositeExplicitAutograd")
def _quantized_sparse_ffn_default(x, matrix, num_used, bias, activation, glu, bundle_format, index=None, threshold=0.0):
    return quantized_sparse_ffn_reference(x, matrix, num_used, bias, activation, glu, bundle_format, index, threshold)


@torch.library.register_fake("flashllm::quantized_sparse_ffn")
def _quantized_sparse_ffn_fake(x, matrix, num_used, bias, activation, glu, bundle_format, index=None, threshold=0.0):
    _check_quantized_sparse_ffn_metadata(x, matrix, num_used, bias, activation, glu, bundle_format, index, threshold)
    return x.new_empty(x.shape)


def quantized_sparse_ffn(
    x: torch.Tensor,
    matrix: torch.Tensor,
    *,
    num_used: int,
    activation: str,
    glu: bool,
    bundle_format: str,
    bias: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
    threshold: float = 0.0,
) -> torch.Tensor:
    """The FFN of x over the quantized neuron bundles in the rows of `matrix` (integer dot products per block, float32
    accumulation).

    x: [T, d] float32 | float16 | bfloat16
    matrix: uint8 [C, BundleFormat.parse(bundle_format).row_bytes(d, glu)], contiguous
    bundle_format: "<in>+<down>", each of "q8_0" | "q4_0" | "q4_1" (flashllm_ext.ops.blocks)
    num_used, activation, bias, index, threshold: as sparse_ffn's
    Returns y: [T, d] of x.dtype.
    """
    return torch.ops.flashllm.quantized_sparse_ffn.default(
        x, matrix, num_used, bias, activation, glu, bundle_format, index, threshold
    )
