"""The native libraries as the tests see them: the CPU code paths this machine runs, a fixture forcing each in turn,
and the test-only SIMT extension."""

import importlib
import os

import pytest


def cpu_isas(highest: str | None = None, paths: tuple[str, ...] | None = None) -> list[str]:
    """The CPU code paths this machine runs, up to `highest` (for kernels with no path above it), among `paths`
    (the levels a kernel has code of its own for: a level without runs the one below, already tested)."""
    from flashllm_ext import _C

    order = _C.cpu_isas()
    top = min(order.index(highest or order[-1]), order.index(_C.detected_cpu_isa()))
    return [isa for isa in order[: top + 1] if paths is None or isa in paths]


def forced_isa_fixture(isas: list[str]):
    """A fixture that runs each test once per ISA in `isas`, forcing the native kernels onto that path."""

    @pytest.fixture(params=isas)
    def isa(request):
        from flashllm_ext import _C

        previous = _C.cpu_isa()
        _C.set_cpu_isa(request.param)
        yield request.param
        _C.set_cpu_isa(previous)

    return isa


def require_simt():
    """flashllm_ext._simt, the test-only SIMT extension. The tests of a module that calls this at import are skipped
    only when FLASHLLM_NATIVE=0 or FLASHLLM_SIMT=0 asks for a build without it; otherwise a build without _simt is
    broken and its import error fails the run, as a missing _C does."""
    for switch in ("FLASHLLM_NATIVE", "FLASHLLM_SIMT"):
        if os.environ.get(switch, "1") == "0":
            pytest.skip(f"{switch}=0: the SIMT extension is not built", allow_module_level=True)
    return importlib.import_module("flashllm_ext._simt")
