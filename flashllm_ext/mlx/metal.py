"""Where the Metal kernel bodies are and whether this machine runs them. The ops ask `metal.metal_available()`
through this module, so a test can force their mlx-op fallback on a Mac by replacing it here."""

from __future__ import annotations

from importlib import resources

import mlx.core as mx

# Metal kernel bodies: `flashllm_ext/metal` is a link to the top-level `metal/` in a checkout and a real folder in
# an installed package (package data in pyproject.toml), so one resource path serves both.
METAL_DIR = resources.files("flashllm_ext") / "metal"


def metal_available() -> bool:
    return mx.metal.is_available()


def metal_source(name: str) -> str:
    """Text of the kernel body `metal/<name>`."""
    path = METAL_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"Metal kernel body {name} not found in {METAL_DIR}: broken install?")
    return path.read_text()
