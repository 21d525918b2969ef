"""flashllm_ext.runtime: the heap bound an engine under a budget sets (bound_heap_retention)."""

import ctypes

import pytest

from flashllm_ext import runtime


class FakeLibc:
    """A C library whose mallopt records its calls (and says whether it took them)."""

    def __init__(self, answer: int):
        self.calls = []

        def mallopt(param: int, value: int) -> int:  # a function: the bound sets its argtypes, as on a ctypes one
            self.calls.append((param, value))
            return answer

        self.mallopt = mallopt


@pytest.fixture
def fresh_bound(monkeypatch):
    """bound_heap_retention as if not yet called in this process, its libc a FakeLibc."""
    runtime.bound_heap_retention.cache_clear()
    yield lambda libc: monkeypatch.setattr(ctypes, "CDLL", lambda *_: libc)
    runtime.bound_heap_retention.cache_clear()


def test_the_bound_fixes_glibc_s_mmap_threshold_once(fresh_bound):
    """M_MMAP_THRESHOLD (-3) set to HEAP_MMAP_THRESHOLD, which also turns glibc's dynamic threshold off; once per
    process."""
    libc = FakeLibc(1)
    fresh_bound(libc)
    assert runtime.bound_heap_retention() is True and runtime.bound_heap_retention() is True
    assert libc.calls == [(-3, runtime.HEAP_MMAP_THRESHOLD)] and runtime.HEAP_MMAP_THRESHOLD == 128 << 10


def test_a_libc_that_refuses_or_lacks_mallopt_leaves_the_heap_as_it_is(fresh_bound):
    fresh_bound(FakeLibc(0))
    assert runtime.bound_heap_retention() is False
    runtime.bound_heap_retention.cache_clear()
    fresh_bound(object())  # no mallopt (macOS's libc)
    assert runtime.bound_heap_retention() is False
