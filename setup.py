"""Build the native parts of flashllm_ext.

Extensions:
  flashllm_ext._C     CPU kernels (always) + CUDA kernels (when torch has CUDA and CUDA_HOME is set).
  flashllm_ext._simt  CUDA and Metal kernel bodies compiled as C++ over the CPU SIMT emulation; tests only.

FLASHLLM_CUDA=0|1|auto (default auto) controls the CUDA part; FLASHLLM_URING=0 leaves out the io_uring engine
that is otherwise built when liburing-dev is installed; FLASHLLM_SIMT=0 leaves out _simt (a GPU machine that runs
only the real kernels builds faster); FLASHLLM_NATIVE=0 skips every native build, leaving the pure-torch reference
kernels. FLASHLLM_OPT (e.g. -O1) replaces the C++ optimisation level of both extensions: the sanitizer build takes
-O1, AddressSanitizer's recommended level, since its instrumentation makes -O3 compile two to three times slower.
"""

import glob
import os
import sys

import torch
from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
OPT = os.environ.get("FLASHLLM_OPT")
CXX_FLAGS = [OPT or "-O3", "-std=c++20", "-fopenmp", "-fvisibility=hidden", "-Wall", "-Wno-unused-function"]
LINK_FLAGS = ["-fopenmp"]


def _runtime_libstdcxx() -> list[str]:
    """The shared libstdc++ this process runs with (torch loaded it), named as a link input on Linux.

    A compiler that links libstdc++ statically (the GPU image's /opt/gcc/bin/g++, seen 2026-11-27 on an H100) gives
    the extension its own copy of the locale machinery next to the shared one torch uses: the first error message
    that formats a number (any TORCH_CHECK with an integer in it) then segfaults in std::ostream. Named before the
    driver's own -lstdc++, the shared library resolves every symbol it has, so no archive member joins the extension.
    tests/test_import.py checks the built libraries for such a copy."""
    if not sys.platform.startswith("linux"):
        return []
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "/libstdc++.so" in line})[:1]


def _sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _want_cuda() -> bool:
    mode = os.environ.get("FLASHLLM_CUDA", "auto").lower()
    # Decide from how torch was built, never from torch.cuda.is_available(): build machines may have no driver.
    has_cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if mode == "1" and not has_cuda:
        raise RuntimeError("FLASHLLM_CUDA=1 but torch has no CUDA or CUDA_HOME is not set")
    return has_cuda if mode == "auto" else mode == "1"


def _want_uring() -> bool:
    """The FlashReader's io_uring engine joins when liburing's header is installed (FLASHLLM_URING=0 opts out)."""
    if os.environ.get("FLASHLLM_URING", "auto") == "0":
        return False
    return any(os.path.exists(os.path.join(d, "liburing.h")) for d in ("/usr/include", "/usr/local/include"))


def _extensions() -> list:
    if os.environ.get("FLASHLLM_NATIVE", "1") == "0":
        return []
    include_dirs = [os.path.join(ROOT, "csrc")]
    sources = _sources("csrc/common/*.cpp") + _sources("csrc/cpu/*.cpp") + _sources("csrc/io/*.cpp")
    extra = {"cxx": CXX_FLAGS}
    ext_cls = cpp_extension.CppExtension
    if _want_cuda():
        ext_cls = cpp_extension.CUDAExtension
        sources += _sources("csrc/cuda/*.cu") + _sources("csrc/cuda/*.cpp")
        extra["nvcc"] = ["-O3", "-std=c++17"]
    libstdcxx = _runtime_libstdcxx()
    link = LINK_FLAGS + libstdcxx
    if _want_uring():
        extra = {key: flags + ["-DFLASHLLM_WITH_URING"] for key, flags in extra.items()}
        link.append("-luring")
    main = ext_cls(
        "flashllm_ext._C", sources, include_dirs=include_dirs, extra_compile_args=extra, extra_link_args=link
    )
    simt = cpp_extension.CppExtension(
        "flashllm_ext._simt",
        _sources("csrc/simt/*.cpp"),
        include_dirs=include_dirs,
        extra_compile_args={
            "cxx": [
                OPT or "-O2",
                "-std=c++20",
                "-fvisibility=hidden",
                "-Wall",
                "-pthread",
                # kernel bodies pun types (vector stores) and carry nvcc's #pragma unroll
                "-fno-strict-aliasing",
                "-Wno-unknown-pragmas",
            ]
        },
        extra_link_args=["-pthread"] + libstdcxx,
    )
    # An extension without sources (e.g. before its first kernel lands) is simply not built.
    wanted = (main, simt) if os.environ.get("FLASHLLM_SIMT", "1") != "0" else (main,)
    return [ext for ext in wanted if ext.sources]


setup(ext_modules=_extensions(), cmdclass={"build_ext": cpp_extension.BuildExtension})
