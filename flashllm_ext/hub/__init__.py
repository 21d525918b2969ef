"""The embedded default model (SmolLM2-135M-Instruct, GGUF) and the tools around it: fetching, the
`transformers` reference model, offline English text and perplexity."""

from flashllm_ext.hub.fetch import fetch_default, resolve_cache_dir
from flashllm_ext.hub.hf import (
    FFN_KINDS,
    collect_linear_inputs,
    decoder_layers,
    ffn_linear_names,
    load_hf_model,
    replace_weights,
    save_hf_checkpoint,
)
from flashllm_ext.hub.text import corpus_text, corpus_token_ids, perplexity, spread_windows

__all__ = [
    "FFN_KINDS",
    "collect_linear_inputs",
    "corpus_text",
    "decoder_layers",
    "corpus_token_ids",
    "fetch_default",
    "ffn_linear_names",
    "load_hf_model",
    "perplexity",
    "replace_weights",
    "resolve_cache_dir",
    "save_hf_checkpoint",
    "spread_windows",
]
