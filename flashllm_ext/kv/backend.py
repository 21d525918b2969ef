"""What every attention backend of this package (near storage, host baseline, X-cache) shares as a context manager:
a clean exit closes it (the last spills written), an exit by an exception terminates it (workers stopped, nothing
spilled, so a failure is not followed by writes of state the failure may have left half done)."""

from __future__ import annotations

from typing import Self

import torch


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


def pair_starts(starts: torch.Tensor | list[int] | None, batch: int, kv_heads: int) -> torch.Tensor | None:
    """Left padding of a batch, starts[b] = the pad tokens before sequence b (None or all zero: no padding), as the
    start of every (batch, kv head) pair: int64 [batch x kv_heads], or None."""
    if starts is None:
        return None
    starts = torch.as_tensor(starts, dtype=torch.int64).reshape(-1)
    if starts.numel() != batch or bool((starts < 0).any()):
        raise ValueError(f"starts must be {batch} non-negative pad counts (one per sequence), got {starts.tolist()}")
    return starts.repeat_interleave(kv_heads) if bool(starts.any()) else None
