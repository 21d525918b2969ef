"""HalfLinear: an nn.Linear whose CPU forward for float16 / bfloat16 weights is flashllm::half_linear.

A flash-loaded model keeps its resident weights (attention, LM head, dense FFNs) in the store's half precision. For
one token PyTorch's CPU fp16 matrix-vector product is already at the read bound, but where tokens share a pass
(prompts, batches) it falls behind: the kernel was 1.5-1.9x faster at 8 tokens and 2.9-3.5x at 64 on this project's
AVX-512 machines, one thread (bench/bench_half_linear.py, BENCHMARKS.md). load_flash swaps its CPU model's half-precision nn.Linear layers to this class in place
(`use_half_linears`): same Parameters (tied weights stay tied), same state dict, F.linear on any other device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashllm_ext import ops

HALF_DTYPES = (torch.float16, torch.bfloat16)


class HalfLinear(nn.Linear):
    """nn.Linear; x [..., in_features] -> [..., out_features] through flashllm::half_linear on the CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or self.weight.dtype not in HALF_DTYPES:
            return F.linear(x, self.weight, self.bias)
        y = ops.half_linear(x.reshape(-1, self.in_features), self.weight, bias=self.bias)
        return y.view(*x.shape[:-1], self.out_features)


def use_half_linears(model: nn.Module) -> int:
    """Turn every plain nn.Linear of `model` with a float16 / bfloat16 weight into a HalfLinear, in place (the
    module object and its Parameters stay; only its class changes). Returns how many were changed."""
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.dtype in HALF_DTYPES:
            module.__class__ = HalfLinear
            changed += 1
    return changed
