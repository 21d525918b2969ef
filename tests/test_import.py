import os
import shutil
import subprocess
import sys

import pytest
import torch

import flashllm_ext


def test_native_library_loaded():
    # `make test` builds the extension first; a silent fallback to the reference kernels would hide a broken build.
    assert flashllm_ext.native_available


def test_import_neither_initialises_cuda_nor_imports_mlx():
    # On every platform, Apple Silicon included: the mlx ops live in flashllm_ext.mlx, imported explicitly.
    code = "import sys, torch, flashllm_ext; print(torch.cuda.is_initialized(), 'mlx' in sys.modules)"
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
    """ops/native.py alone imports _C; the reader asks it rather than importing the package root."""
    from pathlib import Path

    from flashllm_ext.ops import native as _native
    from flashllm_ext.flash import reader

    assert _native.native_available == flashllm_ext.native_available
    package = Path(flashllm_ext.__file__).parent
    importers = [str(p.relative_to(package)) for p in package.rglob("*.py") if "import _C" in p.read_text()]
    assert importers == ["ops/native.py"]
    assert "import flashllm_ext" not in Path(reader.__file__).read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("nm") is None, reason="needs Linux and nm")
def test_native_libraries_use_the_shared_libstdcxx():
    # A toolchain that links libstdc++ statically puts a second copy of the locale machinery in the extension, and
    # the first error message with a number in it then segfaults (the GPU image's /opt/gcc, 2026-11-27; setup.py's
    # _runtime_libstdcxx): std::locale::id::_M_id is libstdc++'s own and must come from the shared library.
    from flashllm_ext import _C

    libraries = [_C.__file__]
    try:
        from flashllm_ext import _simt

        libraries.append(_simt.__file__)
    except ImportError:
        pass
    for library in libraries:
        defined = subprocess.run(["nm", "--defined-only", library], capture_output=True, text=True, check=True).stdout
        assert "_ZNKSt6locale2id5_M_idEv" not in defined, f"{library} holds a static copy of libstdc++: rebuild it"
