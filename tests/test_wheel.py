"""The package as users get it: the wheel built from this checkout, installed into a fresh virtual environment.

The environment sees the system's site-packages so torch is not downloaded again; the wheel is installed into it
with --ignore-installed, so an editable install of the checkout (what `make build` leaves) does not stand in for it.
Every command runs outside the checkout, whose flashllm_ext would otherwise be imported first.
"""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # builds the wheel (reusing build/, ~10 s) and a virtual environment

# What the installed package reports about itself, as JSON.
PROBE = """
import json
from importlib import resources
import torch
import flashllm_ext
from flashllm_ext import _C, endor

w = torch.where(torch.rand(7, 13) < 0.5, torch.randn(7, 13), 0.0)
print(json.dumps({
    "package": flashllm_ext.__file__,
    "native": flashllm_ext.native_available,
    "native_library": _C.__file__,
    "decompressed": torch.equal(endor.compress(w).decompress(), w),
    "metal": sorted(f.name for f in (resources.files("flashllm_ext") / "metal").iterdir() if f.name.endswith(".metal")),
}))
"""


def _run(args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True)
    assert out.returncode == 0, f"{args} failed:\n{out.stderr}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(wheel, virtual environment) with the wheel installed."""
    work = tmp_path_factory.mktemp("wheel")
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", work / "dist", ROOT],
        cwd=ROOT,
    )
    (wheel,) = (work / "dist").glob("flashllm_ext-*.whl")
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", venv], cwd=work)
    _run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", wheel], cwd=work)
    return wheel, venv


def test_wheel_holds_every_module_and_kernel_body(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {p.relative_to(ROOT).as_posix() for p in (ROOT / "flashllm_ext").rglob("*.py")}
    want |= {f"flashllm_ext/metal/{p.name}" for p in (ROOT / "metal").glob("*.metal")}
    assert want <= names, sorted(want - names)


def test_installed_package_loads_native_library_and_finds_metal_bodies(installed):
    _, venv = installed
    got = json.loads(_run([venv / "bin" / "python", "-c", PROBE], cwd=venv).stdout)
    site = venv / "lib"
    assert Path(got["package"]).is_relative_to(site), got["package"]
    assert got["native"] and Path(got["native_library"]).is_relative_to(site)
    assert got["decompressed"]
    assert got["metal"] == sorted(p.name for p in (ROOT / "metal").glob("*.metal"))


def test_console_script_runs(installed):
    _, venv = installed
    out = _run([venv / "bin" / "flashllm", "--help"], cwd=venv)
    assert out.stdout.startswith("usage: flashllm")
