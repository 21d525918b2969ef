"""The lean decoder: model files per family over the store's weights, a static KV cache, the engine's FFN modes, and
its own generate loop (flashllm_ext/decoder/generate.py), with no transformers import on its path."""

from flashllm_ext.decoder.config import FAMILIES, DecoderConfig
from flashllm_ext.decoder.kv_cache import StaticKVCache
from flashllm_ext.decoder.model import LeanDecoder, load_decoder

__all__ = ["FAMILIES", "DecoderConfig", "LeanDecoder", "StaticKVCache", "load_decoder"]
