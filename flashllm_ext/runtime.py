"""What every engine shares: budgets parsed into bytes, tensor bytes counted once per storage, the device check, and
the Runtime base class of the flash and offload engines (close, unpatch refusing a stale runtime, stats)."""

from __future__ import annotations

import functools
import math
import re
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def parse_budget(budget: int | float | str, model_bytes: int, name: str = "dram_budget") -> int:
    """Bytes from a budget: an int (bytes), "50%" (of the model's bytes: resident tensors + every FFN bundle),
    or a size like "200MB" / "1.5GiB". `name` is the argument's name in errors."""
    if isinstance(budget, (int, float)) and not isinstance(budget, bool):
        if not math.isfinite(budget):
            raise ValueError(f"{name} must be a finite number of bytes, got {budget!r}")
        value = int(budget)
    else:
        text = str(budget).strip().lower().replace(" ", "")
        match = re.fullmatch(r"(\d+(?:\.\d+)?)(%|[kmg]i?b|b)?", text)
        if match is None:
            raise ValueError(f"{name} must be bytes, a percentage like '50%' or a size like '200MB', got {budget!r}")
        number, unit = float(match.group(1)), match.group(2) or ""
        value = int(number / 100 * model_bytes) if unit == "%" else int(number * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"{name} must be at least 1 byte, got {budget!r}")
    return value


# glibc's mallopt parameter number and the value fixed under a budget (see bound_heap_retention)
_M_MMAP_THRESHOLD = -3
HEAP_MMAP_THRESHOLD = 128 << 10


@functools.cache
def bound_heap_retention() -> bool:
    """Under a DRAM budget: fix glibc's mmap threshold at HEAP_MMAP_THRESHOLD (its initial value) so that a
    temporary of 128 KiB or more that the heap has no free room for is mapped, and returned to the system when freed,
    instead of growing the heap. By default glibc raises the threshold to the size of each mapped block freed (up to
    32 MiB), after which such temporaries grow the heap and their freed space is kept there: a Llama-2-7B-shaped lean decoder's prefill grew it by ~90 MB beyond the
    budget (its process OOM-killed at its limit), ~16 MB with the threshold fixed. Once per process; True where
    applied (glibc), False elsewhere (another C library: nothing to do)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD))


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        t = getattr(t, "blocks", t)  # a QuantizedWeight (flashllm_ext.ops.blocks): its blocks hold its bytes
        if t is None or t.device.type == "meta":
            continue
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:  # tied weights share a storage: count it once
            seen.add(key)
            total += key[1]
    return total


def cuda_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device, refused with a clear message when it is CUDA and no CUDA device is usable."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {device} was asked for but CUDA is not available (torch {torch.__version__}, "
            f"built with CUDA {torch.version.cuda}): run on a machine with an NVIDIA GPU and a CUDA "
            f"build of torch, or use device='cpu'"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device}")
    return device


class Runtime:
    """What an engine installed in a model, reachable as `model.<attribute>` ("flash", "offload"): `stats()` of the
    tokens run so far, `close()` to release its reader and threads, and `unpatch(model)` to put back the modules it
    replaced (a runtime made by patching a loaded model only; one built with the model has nothing to put back).

    Subclasses set `attribute` and `built_by` (the loader whose models have no originals), keep `originals` and
    `hooks` (removable handles), and implement `stats`, `close` and `_restore_originals`."""

    attribute: ClassVar[str]
    built_by: ClassVar[str]
    originals: list
    hooks: list

    def stats(self) -> dict:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _restore_originals(self) -> None:
        raise NotImplementedError

    def install_on(self, model: nn.Module) -> None:
        """Make this runtime `model.<attribute>` (and the deprecated `model.<attribute>_stats()`)."""
        setattr(model, self.attribute, self)
        setattr(
            model,
            f"{self.attribute}_stats",
            deprecated_alias(self.stats, f"model.{self.attribute}_stats()", f"model.{self.attribute}.stats()"),
        )

    def unpatch(self, model: nn.Module) -> None:
        """Put the original modules back, remove the hooks and release the reader. Refuses (RuntimeError) a model this
        runtime was built with and a model it no longer serves (unpatched already, or another model)."""
        if not self.originals:
            raise RuntimeError(f"this model was built by {self.built_by}: it has no original modules to restore")
        if getattr(model, self.attribute, None) is not self:
            raise RuntimeError(
                "this runtime no longer serves that model (unpatched already, or not the model it patched)"
            )
        self.close()
        for hook in self.hooks:
            hook.remove()
        self._restore_originals()
        for attr in (self.attribute, f"{self.attribute}_stats"):
            model.__dict__.pop(attr, None)


def deprecated_alias(function: Callable[..., Any], old: str, new: str) -> Callable[..., Any]:
    """`function` under its old name `old`, kept for one release: each call warns (DeprecationWarning) to use `new`."""

    @functools.wraps(function)
    def alias(*args, **kwargs):
        warnings.warn(
            f"{old} is deprecated and will be removed in the next release: use {new}", DeprecationWarning, stacklevel=2
        )
        return function(*args, **kwargs)

    return alias
