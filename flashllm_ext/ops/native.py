"""The native library flashllm_ext._C, loaded once: importing it registers the native kernels of the op schemas
(flashllm_ext.ops must be imported first) and the FlashReader class. `native_available` says whether it was built."""

from __future__ import annotations

from types import ModuleType

try:
    from flashllm_ext import _C
except ImportError:
    _C = None

native_available: bool = _C is not None


def require_native(what: str) -> ModuleType:
    """The loaded _C, or a RuntimeError saying that `what` needs it."""
    if _C is None:
        raise RuntimeError(f"{what} needs the native library flashllm_ext._C (build it: make build)")
    return _C
