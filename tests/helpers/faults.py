"""Injected faults: a reader whose read fails mid-generation, and a FIFO where a regular file is expected."""

from contextlib import contextmanager

import pytest


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
