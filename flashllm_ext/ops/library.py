"""The `flashllm` op library: every schema of torch.ops.flashllm is defined on LIB (ops/<family>.py)."""

from __future__ import annotations

import torch

LIB = torch.library.Library("flashllm", "DEF")

# Each op's checks come in two parts, worded as the native kernels word them (csrc/common/<op>_checks.h):
# `_check_<op>_metadata` (dtypes, ranks, shapes, devices; messaged torch._check, so the fake kernels make them too,
# at no cost and without reading data) and, in the reference kernels only, the data checks that need the values.
