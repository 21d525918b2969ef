"""What every attention backend of this package (near storage, host baseline, X-cache) shares as a context manager:
a clean exit closes it (the last spills written), an exit by an exception terminates it (workers stopped, nothing
spilled, so a failure is not followed by writes of state the failure may have left half done)."""
from __future__ import annotations

from typing import Self


class AttentionBackend:
    def close(self) -> None:
        raise NotImplementedError

    def terminate(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self.terminate()
