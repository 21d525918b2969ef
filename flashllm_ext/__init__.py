"""flashllm_ext: run LLMs whose weights do not fit in memory.

Importing this package registers the `torch.ops.flashllm.*` schemas with pure-torch reference kernels, then
loads the native library once if it was built (`_native`: CPU kernels, and CUDA kernels when built with CUDA). It never
initialises CUDA and never imports mlx: the ops on mlx arrays are in `flashllm_ext.mlx`, imported explicitly.
"""
from __future__ import annotations

from . import _ops  # noqa: F401  (registers schemas, fake and reference kernels)
from ._native import native_available  # loads _C: native kernels for the schemas above
from .errors import FormatError
from . import endor, ops
from .engine import load_flash, patch_model

__all__ = ["FormatError", "endor", "load_flash", "native_available", "ops", "patch_model"]
