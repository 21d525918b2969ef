"""Text in and out without transformers on the run path: a checkpoint's fast tokenizer (tokenizer.json, read by the
`tokenizers` library) and its chat template (tokenizer_config.json, rendered by jinja2).

A GGUF file carries its vocabulary, not a tokenizer.json: transformers converts it once, and the result is kept under
~/.cache/flashllm_ext/tokenizers/ (named by the file's name, size and mtime), so later runs import neither.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

CACHE = Path.home() / ".cache" / "flashllm_ext" / "tokenizers"


class TextTokenizer:
    """encode / decode / chat of one checkpoint. `eos_ids`: the ids that end a reply (the config's eos token and,
    for chat models, the template's end-of-turn token when it is a special token)."""

    def __init__(self, directory: Path):
        from tokenizers import Tokenizer

        self.directory = directory
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config_file = directory / "tokenizer_config.json"
        self.config = json.loads(config_file.read_text()) if config_file.exists() else {}
        self.bos_token, self.eos_token = (_token_text(self.config.get(k)) for k in ("bos_token", "eos_token"))
        self.eos_ids = {i for i in (self.token_id(self.eos_token), self.token_id("<|im_end|>")) if i is not None}
        template_file = directory / "chat_template.jinja"  # where transformers 5 writes it
        self.chat_template = template_file.read_text() if template_file.exists() else self.config.get("chat_template")

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_id(self, text: str | None) -> int | None:
        return None if text is None else self.tokenizer.token_to_id(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def chat(self, messages: list[dict[str, str]]) -> str:
        """The prompt text of a conversation under the checkpoint's chat template, ending where the assistant's
        reply begins. ValueError when the checkpoint has none."""
        if not self.chat_template:
            raise ValueError(f"{self.directory}: the tokenizer has no chat template")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def load_tokenizer(path: str | os.PathLike) -> TextTokenizer:
    """The tokenizer of a Hugging Face directory (tokenizer.json) or a .gguf file (converted once, then cached).
    ValueError when there is none."""
    path = Path(path)
    if path.is_dir():
        if not (path / "tokenizer.json").exists():
            raise ValueError(f"{path}: no tokenizer loads from it (a folder needs tokenizer.json)")
        return TextTokenizer(path)
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(f"{path}: no tokenizer loads from it (expected a folder with tokenizer.json or a .gguf file)")
    info = path.stat()
    cached = CACHE / f"{path.stem}-{info.st_size}-{int(info.st_mtime)}"
    if not (cached / "tokenizer.json").exists():
        _convert_gguf_tokenizer(path, cached)
    return TextTokenizer(cached)


def _convert_gguf_tokenizer(gguf: Path, out: Path) -> None:
    """transformers' conversion of a GGUF vocabulary into tokenizer files, written to a temporary folder and renamed
    into place (a concurrent run finds either nothing or the whole folder)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{gguf}: no tokenizer loads from it ({type(e).__name__}: {e})") from None
    finally:
        logging.set_verbosity(verbosity)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, out)
        except OSError:  # another run renamed its copy first
            if not (out / "tokenizer.json").exists():
                raise
        else:
            os.mkdir(tmp)  # for TemporaryDirectory's cleanup
