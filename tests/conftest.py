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
