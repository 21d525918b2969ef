# Two commands do everything on a new machine: `make test` and `make demo`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
export MAX_JOBS ?= 2

.PHONY: deps build test test-fast lint sanitize demo bench llama-cpp cuda-check cuda-glue-check clean

# Installs what the project needs. torch is installed only when absent, so a CUDA torch already on the
# machine is never replaced (pip would otherwise pull the newest CUDA wheel, several GB).
deps: .deps.stamp
.deps.stamp: pyproject.toml Makefile
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	# compressed-tensors 0.13.0: the newest release that still ships the sparse-bitmask compressor tests/test_endor.py
	# checks interop with (0.15 removed it) and that accepts transformers 5 (0.14 pins transformers<5).
	$(PIP) install -q numpy "safetensors>=0.4" tqdm "transformers>=4.45" accelerate "gguf>=0.10" \
		pytest pytest-xdist hypothesis matplotlib ninja compressed-tensors==0.13.0 "setuptools>=64" wheel ruff \
		clang-format
	# mlx (the [mlx] extra): the Metal kernels and the MLX engine on Apple Silicon, mlx's CPU device on Linux (tested
	# here); elsewhere pip ignores both lines and the MLX tests skip, saying so.
	$(PIP) install -q "mlx; sys_platform == 'darwin' and platform_machine == 'arm64'" \
		"mlx[cpu]; sys_platform == 'linux'" || true
	# kvikio (the [gpu] extra): FlashReader's SSD -> GPU reads, only where a CUDA torch sees a GPU.
	$(PYTHON) -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null && \
		$(PIP) install -q kvikio-cu13 || true
	# fio: the disk baseline of bench/bench_io.py; liburing-dev: optional io_uring engine of the FlashReader.
	@command -v fio >/dev/null && test -f /usr/include/liburing.h || { command -v apt-get >/dev/null && \
		apt-get update -qq && apt-get install -y -qq fio liburing-dev; } || echo "warning: fio/liburing-dev not installed"
	touch $@

# Incremental native build (ninja), in place so tests and bench run from the checkout; then the checkout installed
# as editable (setuptools >= 64, in deps), for the `flashllm` command and imports from any folder. The install builds nothing
# (FLASHLLM_NATIVE=0): pip's editable build would compile everything again in a throwaway folder, and the in-place
# _C and _simt are already where the editable install points. pyenv sees a new command only after a rehash.
build: deps
	$(PYTHON) setup.py -q build_ext --inplace
	FLASHLLM_NATIVE=0 $(PIP) install -q --no-build-isolation --no-deps -e .
	@! command -v pyenv >/dev/null || pyenv rehash

# The tests run in TEST_WORKERS processes (pytest-xdist; worksteal hands the long benchmark runs to whichever is free),
# their OpenMP threads sleeping when idle (OMP_WAIT_POLICY=passive): a worker's spinning threads would take the cores
# the other one computes on.
TEST_WORKERS ?= 2
PYTEST := OMP_WAIT_POLICY=passive $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

test: build
	$(PYTEST)

test-fast: build
	$(PYTEST) -m "not slow"

# ruff's lint and format checks on every Python file (pyproject.toml [tool.ruff]) and clang-format's on the C++ and
# CUDA sources (.clang-format); `pre-commit install` runs the same on each commit.
CXX_SOURCES = $(shell git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh')
lint: deps
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -c "import clang_format; clang_format.clang_format()" --dry-run --Werror $(CXX_SOURCES)

# The native extensions built with AddressSanitizer and UndefinedBehaviorSanitizer in their own folder
# (build-asan/lib holds a whole package, which the tests import first) at -O1 (the whole target took 21.5 minutes on 2
# cores against 23 at -O3), then the fast tests against them (about 10 minutes in two workers on 2 cores; the slow ones
# load the real model or build the wheel, no native code the fast ones miss).
# Left out too, as `make test` runs them: the tests whose native calls the ops, store, engine, decoder and KV tests
# make already (the command line, the benchmarks' harnesses, llama.cpp's, the hub, the demos, the MLX engine).
# python itself is not instrumented, so libasan is preloaded, and libstdc++ with it: python does not link libstdc++,
# and ASan must find the real __cxa_throw when it starts or it aborts at the first C++ exception.
# LeakSanitizer is off: python and torch keep interned objects, caches and op registries alive until exit on
# purpose, and it would report those. halt_on_error: a UBSan report fails the run. --capture=sys leaves the
# sanitizers' reports (written to file descriptor 2, which the test workers share with make) on the terminal; pytest
# would otherwise capture and lose them when a report aborts the process (the run then fails on the crashed worker).
SANITIZE := -fsanitize=address,undefined -fno-omit-frame-pointer
SANITIZE_SKIP := $(addprefix --ignore=tests/,test_cli.py bench harness hub demos mlx)
sanitize: build
	rm -rf build-asan/lib  # setup.py build copies modules in but never removes one: a moved module would linger
	FLASHLLM_OPT=-O1 CFLAGS="-g $(SANITIZE)" LDFLAGS="$(SANITIZE)" $(PYTHON) setup.py -q build --build-base build-asan \
		--build-lib build-asan/lib
	LD_PRELOAD="$$($${CXX:-c++} -print-file-name=libasan.so) $$($${CXX:-c++} -print-file-name=libstdc++.so)" \
		ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
		$(PYTEST) -m "not slow" -o pythonpath=build-asan/lib --capture=sys $(SANITIZE_SKIP)

# The main job (text generated with the FFN weights on flash, every engine mode), then Endor compression.
demo: build
	$(PYTHON) -m flashllm_ext.demos.flash
	$(PYTHON) -m flashllm_ext.demos.endor

# Every benchmark at its default sizes (hours on two cores; `--smoke` runs of them are part of `make test`), naming
# what it skips and why. The GPU rows are .ci/gpu-checks' (a machine with a GPU).
bench: build
	@for script in bench/bench_*.py; do \
		case $$script in \
			*bench_mlx.py) $(PYTHON) -c "import mlx.core" 2>/dev/null || \
				{ echo "skipped $$script: mlx does not import (pip install 'mlx[cpu]', or Apple Silicon)"; continue; } ;; \
			*bench_io.py) command -v fio >/dev/null || { echo "skipped $$script: fio is not installed (make deps)"; \
				continue; } ;; \
		esac; \
		name=$$(basename $$script .py); \
		echo "== $$script"; $(PYTHON) -m bench.$$name || exit 1; \
	done

# llama.cpp, the benchmarks' mmap peer: llama-cpp-python built from source for this CPU into a virtual environment
# of its own, $$FLASHLLM_CACHE/llama-cpp/venv or $$FLASHLLM_LLAMA_CPP_ENV (minutes; once, then reused). Not part of
# deps or test: CI never builds it, and its tests skip without it.
llama-cpp: deps
	$(PYTHON) -m flashllm_ext.harness.llama_cpp --build

# Compiles every CUDA source for Ampere and Hopper without torch headers; needs nvcc only, no driver.
CUDA_SOURCES := $(wildcard csrc/cuda/*.cu)
cuda-check:
	@test -n "$(CUDA_SOURCES)" || { echo "no CUDA sources"; exit 1; }
	@for arch in sm_80 sm_90a; do for f in $(CUDA_SOURCES); do \
		echo "nvcc $$arch $$f"; \
		nvcc -std=c++17 -O3 -arch=$$arch -Xptxas -v -Icsrc -c $$f -o /dev/null || exit 1; \
	done; done

# Builds the real _C with its CUDA kernels and torch glue against torch 2.13.0+cu130 (a cached environment under
# $$FLASHLLM_CACHE) and checks the CUDA registrations; needs nvcc only, no driver. See .ci/cuda-glue-check.
cuda-glue-check:
	.ci/cuda-glue-check

clean:
	rm -rf build build-asan flashllm_ext/*.so .deps.stamp
