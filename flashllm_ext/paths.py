"""Where flashllm_ext keeps what it downloads, measures or generates: one cache directory for everything."""
from __future__ import annotations

import os
from pathlib import Path


def resolve_cache_dir(path: str | os.PathLike | None = None) -> Path:
    """The cache directory: `path`, else $FLASHLLM_CACHE, else ~/.cache/flashllm_ext (created if missing)."""
    chosen = Path(path or os.environ.get("FLASHLLM_CACHE") or Path.home() / ".cache" / "flashllm_ext")
    chosen.mkdir(parents=True, exist_ok=True)
    return chosen
