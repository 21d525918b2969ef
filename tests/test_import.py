import os
import subprocess
import sys

import torch

import flashllm_ext


def test_native_library_loaded():
    # `make test` builds the extension first; a silent fallback to the reference kernels would hide a broken build.
    assert flashllm_ext.native_available


def test_import_neither_initialises_cuda_nor_imports_mlx():
    # On every platform, Apple Silicon included: the mlx ops live in flashllm_ext.mlx, imported explicitly.
    code = ("import sys, torch, flashllm_ext; "
            "print(torch.cuda.is_initialized(), 'mlx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_ops_registered():
    assert hasattr(torch.ops.flashllm, "endor_decompress")


def test_kernel_checks_switch():
    # The CUDA ops' host-side data checks (csrc/common/kernel_checks.h): off by default, FLASHLLM_CHECK_KERNELS=1
    # turns them on at load, _C.set_kernel_checks at run time.
    code = "from flashllm_ext import _C; print(_C.kernel_checks())"
    for value, want in (("0", "False"), ("1", "True")):
        env = dict(os.environ, FLASHLLM_CHECK_KERNELS=value)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        assert out.stdout.strip() == want
    from flashllm_ext import _C

    before = _C.kernel_checks()
    _C.set_kernel_checks(not before)
    assert _C.kernel_checks() is (not before)
    _C.set_kernel_checks(before)


def test_native_library_is_loaded_in_one_place():
    """_native.py alone imports _C; the reader asks it rather than importing the package root."""
    from pathlib import Path

    from flashllm_ext import _native, reader

    assert _native.native_available == flashllm_ext.native_available
    package = Path(_native.__file__).parent
    importers = [p.name for p in package.rglob("*.py") if "import _C" in p.read_text()]
    assert importers == ["_native.py"]
    assert "import flashllm_ext" not in Path(reader.__file__).read_text()
