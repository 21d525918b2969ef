import os

import pytest


@pytest.fixture(scope="session")
def default_model():
    """(gguf path, transformers model, tokenizer) of the real default model, loaded once per session.
    Tests that change its weights restore them."""
    from flashllm_ext.hub import fetch_default, load_hf_model

    path = fetch_default()
    model, tokenizer = load_hf_model(path)
    return path, model, tokenizer


@pytest.fixture(scope="module")
def tiny_llama():
    """A tiny random Llama (tests.helpers.models.TINY_LLAMA, seed 0), one per test module."""
    from tests.helpers.models import TINY_LLAMA, tiny_model

    return tiny_model("llama", **TINY_LLAMA)


@pytest.fixture
def umask():
    """Sets the process umask for one test (files' modes depend on it); the previous one is restored after."""
    previous = os.umask(0o022)
    os.umask(previous)
    yield os.umask
    os.umask(previous)
