"""flashllm_ext.hub.tokenizer: the default model's tokenizer without transformers on the run path gives the ids,
text and chat prompt transformers gives, and a folder or file with no tokenizer is refused."""

import pytest

from flashllm_ext.hub import tokenizer as tokenizer_module
from flashllm_ext.hub.tokenizer import load_tokenizer


def test_the_default_tokenizer_equals_transformers(default_model, tmp_path, monkeypatch):
    gguf, _, reference = default_model
    monkeypatch.setattr(tokenizer_module, "CACHE", tmp_path)  # a fresh conversion, not one cached earlier
    tokenizer = load_tokenizer(gguf)
    text = "The three primary colors are red, é 漢字\n  x"
    assert tokenizer.encode(text) == reference(text).input_ids
    assert tokenizer.decode(tokenizer.encode(text)) == text
    messages = [{"role": "user", "content": "Hi"}]
    assert tokenizer.chat(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.eos_ids == {reference.eos_token_id} and len(tokenizer) == len(reference)
    assert load_tokenizer(gguf).directory == tokenizer.directory  # converted once


def test_no_tokenizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer loads"):
        load_tokenizer(tmp_path)
    (tmp_path / "x.txt").write_text("x")
    with pytest.raises(ValueError, match="no tokenizer loads"):
        load_tokenizer(tmp_path / "x.txt")
