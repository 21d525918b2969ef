import importlib
import os
import sys
from contextlib import contextmanager
from pathlib import Path

# Test modules import shared helpers from each other (e.g. make_weight).
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def default_model():
    """(gguf path, transformers model, tokenizer) of the real default model, loaded once per session.
    Tests that change its weights restore them."""
    from flashllm_ext.hub import fetch_default, load_hf_model

    path = fetch_default()
    model, tokenizer = load_hf_model(path)
    return path, model, tokenizer


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


@contextmanager
def read_failure_at(reader, call: int = 5):
    """Within the block, the `call`-th reader.read (inline or in the reader thread) raises an injected OSError, as a
    failing disk would, mid-generation; the real read is back on exit."""
    real_read, calls = reader.read, [0]

    def failing_read(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise OSError(5, "Input/output error (injected)")
        return real_read(*args, **kwargs)

    reader.read = failing_read
    try:
        yield
    finally:
        reader.read = real_read


def page_locked(t) -> bool:
    """Whether tensor t's host memory is page-locked for CUDA as the driver sees it (cuPointerGetAttribute's memory
    type is host): pinned by torch or registered by cudaHostRegister. torch's Tensor.is_pinned() knows only its own
    pinned allocations (2.11: False for registered memory)."""
    import ctypes

    memory_type, host, attribute_memory_type = ctypes.c_uint(), 1, 2  # CU_MEMORYTYPE_HOST, CU_POINTER_ATTRIBUTE_...
    status = ctypes.CDLL("libcuda.so.1").cuPointerGetAttribute(
        ctypes.byref(memory_type), attribute_memory_type, ctypes.c_ulonglong(t.data_ptr())
    )
    return status == 0 and memory_type.value == host


def mapped_ranges(path: str) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of `path` (/proc/self/maps)."""
    real = os.path.realpath(path)
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == real:
                begin, end = (int(a, 16) for a in fields[0].split("-"))
                ranges.append((begin, end))
    return ranges


@pytest.fixture
def umask():
    """Sets the process umask for one test (files' modes depend on it); the previous one is restored after."""
    previous = os.umask(0o022)
    os.umask(previous)
    yield os.umask
    os.umask(previous)


def refuses_without_blocking(load, fifo, match: str = "FIFO, not a regular file", timeout: float = 10.0) -> None:
    """load() must raise FormatError matching `match` at once. A load blocked opening the FIFO `fifo` (open() waits
    for a writer, and some loaders hold the GIL meanwhile) is released after `timeout` seconds by a shell that keeps
    opening the FIFO's write end, and the test fails instead of hanging."""
    import re
    import subprocess
    import time

    from flashllm_ext import FormatError

    release = subprocess.Popen(["sh", "-c", 'sleep "$0"; while :; do : > "$1"; done', str(timeout), str(fifo)])
    start = time.monotonic()
    try:
        with pytest.raises(Exception) as info:
            load()
    finally:
        release.kill()
        release.wait()
    assert time.monotonic() - start < timeout, f"blocked opening the FIFO {fifo}"
    error = info.value
    assert isinstance(error, FormatError) and re.search(match, str(error)) and str(fifo) in str(error), repr(error)
