"""flashllm_ext.runtime: the heap bound an engine under a budget sets (bound_heap_retention)."""

import subprocess
import sys

import pytest

# In a fresh interpreter: a 4 MiB temporary freed (by default glibc then raises its mmap threshold to 4 MiB), then
# 32 temporaries of 256 KiB freed with a small tensor kept between each: the heap's growth in MiB (mallinfo2).
PROBE = """
import ctypes, sys, torch
from flashllm_ext.runtime import bound_heap_retention
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                              "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
if sys.argv[1] == "bounded":
    assert bound_heap_retention()
del_me = torch.empty(4 << 20, dtype=torch.uint8)
del del_me
before, kept = libc.mallinfo2().arena, []
for _ in range(32):
    big = torch.ones(256 << 10, dtype=torch.uint8)
    kept.append(torch.ones(64, dtype=torch.uint8))
    del big
print((libc.mallinfo2().arena - before) >> 20)
"""


def _heap_growth_mib(how: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, how], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator (mallinfo2, mallopt)")
def test_bounded_heap_returns_freed_temporaries_where_glibc_keeps_them():
    """By default the 256 KiB temporaries come from the heap once a larger block was freed, and their space stays
    there between the kept tensors (8 MiB of them); with the threshold fixed each is mapped and returned."""
    assert _heap_growth_mib("default") >= 4
    assert _heap_growth_mib("bounded") == 0
