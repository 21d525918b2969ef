"""flashllm_ext: run LLMs whose weights do not fit in memory.

Importing this package registers the `torch.ops.flashllm.*` schemas with pure-torch reference kernels, then
loads the native library once if it was built (`_native`: CPU kernels, and CUDA kernels when built with CUDA). It never
initialises CUDA and imports mlx only on Apple Silicon with Metal, or when FLASHLLM_BACKEND=mlx asks for it.
"""
from __future__ import annotations

import os
import platform
import sys

from . import _ops  # noqa: F401  (registers schemas, fake and reference kernels)
from ._native import native_available  # loads _C: native kernels for the schemas above
from .errors import FormatError


def _pick_backend() -> str:
    requested = os.environ.get("FLASHLLM_BACKEND", "auto").lower()
    if requested in ("torch", "mlx"):
        return requested
    if requested != "auto":
        raise ValueError(f"FLASHLLM_BACKEND must be torch, mlx or auto, got {requested!r}")
    if sys.platform == "darwin" and platform.machine() == "arm64":
        try:
            import mlx.core as mx

            if mx.metal.is_available():
                return "mlx"
        except ImportError:
            pass
    return "torch"


backend: str = _pick_backend()

from . import endor, ops  # noqa: E402
from .engine import load_flash, patch_model  # noqa: E402

__all__ = ["FormatError", "backend", "endor", "load_flash", "native_available", "ops", "patch_model"]
