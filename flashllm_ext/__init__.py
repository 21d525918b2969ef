"""flashllm_ext: run LLMs whose weights do not fit in memory.

Importing this package registers the `torch.ops.flashllm.*` schemas with pure-torch reference kernels, then
loads the native library once if it was built (`ops.native`: CPU kernels, and CUDA kernels when built with CUDA). It never
initialises CUDA and never imports mlx: the ops on mlx arrays are in `flashllm_ext.mlx`, imported explicitly.
"""

from __future__ import annotations

from flashllm_ext import endor, ops  # ops: registers the schemas with their reference kernels, then loads _C
from flashllm_ext.errors import FormatError
from flashllm_ext.ops.native import native_available
from flashllm_ext.flash.engine import load_flash, patch_flash, patch_model
from flashllm_ext.decoder import load_decoder
from flashllm_ext.offload import load_offload, patch_offload

__all__ = [
    "FormatError",
    "endor",
    "load_decoder",
    "load_flash",
    "load_offload",
    "native_available",
    "ops",
    "patch_flash",
    "patch_offload",
]
