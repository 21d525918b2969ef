import sys
from pathlib import Path

# Test modules import shared helpers from each other (e.g. make_weight).
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def default_model():
    """(gguf path, transformers model, tokenizer) of the real default model, loaded once per session.
    Tests that change its weights restore them."""
    from flashllm_ext.models import fetch_default, load_hf_model

    path = fetch_default()
    model, tokenizer = load_hf_model(path)
    return path, model, tokenizer


ISA_ORDER = ("scalar", "avx2", "avx512", "avx512vbmi2")


def cpu_isas(highest: str = ISA_ORDER[-1]) -> list[str]:
    """The CPU code paths this machine runs, up to `highest` (for kernels with no path above it)."""
    from flashllm_ext import _C

    top = min(ISA_ORDER.index(highest), ISA_ORDER.index(_C.detected_cpu_isa()))
    return list(ISA_ORDER[:top + 1])


def forced_isa_fixture(isas: list[str]):
    """A fixture that runs each test once per ISA in `isas`, forcing the native kernels onto that path."""
    @pytest.fixture(params=isas)
    def isa(request):
        from flashllm_ext import _C

        previous = _C.cpu_isa()
        _C.set_cpu_isa(request.param)
        yield request.param
        _C.set_cpu_isa(previous)

    return isa
