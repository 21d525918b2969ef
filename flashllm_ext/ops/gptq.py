"""GPTQ rounding (Frantar et al. 2022): a weight matrix's integer codes chosen against the inputs it multiplies.

Round to nearest minimises each weight's own error ||w - w_q||^2. GPTQ minimises the error of the layer's outputs
on calibration inputs X [N, d], ||X (w - w_q)^T||^2: it rounds the columns in order and carries each column's
rounding error into the columns not yet rounded, through the inverse of H = X^T X / N (its upper Cholesky factor U:
row j says how column j's error spreads to the columns after it). The grid is fixed before any error is carried
(static groups): w_q = scale * q + offset with q an integer in [lo, hi], one (scale, offset) per group of `group`
consecutive columns of a row, so the codes fit the same format, scales and kernels as round to nearest gives.

Columns are taken in blocks of LAZY_COLUMNS: a column's error updates only the rest of its block at once, the
columns after the block take the whole block's error in one matrix product (the paper's lazy batch update, which
turns d rank-1 updates of the whole matrix into d / LAZY_COLUMNS matrix products).

Used by the predictor's low-bit input projections (flashllm_ext.predictor.quant) and by quantized flash stores
(flashllm_ext.ops.blocks.quantize_rows_gptq, `flashllm convert --rounding gptq`).
"""

from __future__ import annotations

import torch

DAMPING = 0.01  # of the mean diagonal of H, added to its diagonal (GPTQ's default): keeps H invertible
LAZY_COLUMNS = 128


def gptq_factor(inputs: torch.Tensor, row_weights: torch.Tensor | None = None) -> torch.Tensor:
    """The upper Cholesky factor U float32 [d, d] of H^-1, H = X^T W X / sum(W) of calibration inputs X [N, d] (any
    float dtype), each row weighted by row_weights [N] (None: all 1), damped by DAMPING. An input channel that is zero
    on every row gets H_jj = 1: its weights cannot change the outputs, so their rounding error is free and is not
    carried."""
    if inputs.dim() != 2 or not inputs.is_floating_point() or inputs.shape[0] == 0:
        raise ValueError(
            f"GPTQ needs calibration inputs as a 2-D float tensor [N > 0, d], got {inputs.dtype} "
            f"of shape {tuple(inputs.shape)}"
        )
    if row_weights is not None and (row_weights.shape != inputs.shape[:1] or bool((row_weights < 0).any())):
        raise ValueError(f"row_weights must be [{inputs.shape[0]}] and not negative, got {tuple(row_weights.shape)}")
    x = inputs.double()
    weights = torch.ones(x.shape[0], dtype=x.dtype) if row_weights is None else row_weights.double()
    h = (x * weights[:, None]).T @ x / weights.sum()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    h.diagonal().add_(DAMPING * h.diagonal().mean())
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()


def gptq_codes(
    w: torch.Tensor,
    factor: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    group: int,
    lo: int,
    hi: int,
) -> torch.Tensor:
    """Integer codes int16 [n, d] of w [n, d] on the grid w_q = scale * q + offset, q in [lo, hi], rounded by GPTQ.

    factor: gptq_factor of the layer's inputs, [d, d]. scale, offset: float32 [n, ceil(d / group)], one per group
    of `group` columns of each row, as the format stores them (a scale of 0 gives code clamp(0) and w_q = offset)."""
    n, d = w.shape
    groups = -(-d // group)
    if factor.shape != (d, d):
        raise ValueError(f"GPTQ factor must be [{d}, {d}] for w of shape {tuple(w.shape)}, got {tuple(factor.shape)}")
    if scale.shape != (n, groups) or offset.shape != (n, groups):
        raise ValueError(
            f"scale and offset must be [{n}, {groups}] (groups of {group} columns), got {tuple(scale.shape)} and "
            f"{tuple(offset.shape)}"
        )
    inverse = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
    rest = w.float().clone()
    codes = torch.empty(n, d, dtype=torch.int16)
    for start in range(0, d, LAZY_COLUMNS):
        end = min(start + LAZY_COLUMNS, d)
        block = rest[:, start:end]  # a view: the block's columns take each error at once
        u = factor[start:end, start:end]
        errors = torch.empty(n, end - start)
        for j in range(end - start):
            g = (start + j) // group
            q = torch.clamp(torch.round((block[:, j] - offset[:, g]) * inverse[:, g]), lo, hi)
            codes[:, start + j] = q.to(torch.int16)
            error = (block[:, j] - (q * scale[:, g] + offset[:, g])) / u[j, j]
            block[:, j + 1 :] -= error[:, None] * u[j, j + 1 :][None, :]
            errors[:, j] = error
        rest[:, end:] -= errors @ factor[start:end, end:]
    return codes
