"""LLM in a flash: FFN weights in a row-column bundled store on flash, read by neuron through a sliding-window
neuron cache, served to a Hugging Face model within a DRAM budget (engine: load_flash / patch_flash)."""

from __future__ import annotations

from flashllm_ext.flash.cache import NeuronCache
from flashllm_ext.flash.engine import load_flash, patch_flash
from flashllm_ext.flash.stack import MODES, FlashRuntime
from flashllm_ext.flash.reader import FlashReader
from flashllm_ext.flash.store import FlashStore
