"""LeanDecoder: a causal LM read straight from a flash store and run without transformers, its FFNs served by any
engine mode (flashllm_ext/flash/engine.py's modes, the same FFN modules and budget rule).

    decoder = flashllm_ext.load_decoder(store_dir, dram_budget="50%", mode="flash")
    logits = decoder.forward(prompt_ids)          # [vocab] of the last token; the KV cache advances
    decoder.stats(); decoder.reset(); decoder.close()

A token costs its bytes and FLOPs: per layer one fused q/k/v matrix product, RoPE, one write into the static KV
cache, flashllm::decode_attention over the cache in place, the output projection and the FFN; no module dispatch,
hooks or dynamic cache. The budget charges what the decoder holds (resident weights, RoPE tables, the KV cache for
max_len tokens) before the FFN state, as load_flash charges its model's tensors.
"""

from __future__ import annotations

import os
import time
from functools import partial
from collections.abc import Callable, Sequence

import torch
from torch import nn

from flashllm_ext.decoder.config import DecoderConfig
from flashllm_ext.decoder.kv_cache import StaticKVCache
from flashllm_ext.decoder.layers import ResidentWeights, dense_ffns
from flashllm_ext.decoder.gemma import GemmaModel
from flashllm_ext.decoder.llama import LlamaModel
from flashllm_ext.decoder.opt import OPTModel
from flashllm_ext.flash.engine import check_lookahead, predictors_for_mode
from flashllm_ext.flash.experts import expert_stack
from flashllm_ext.flash.stack import FlashRuntime, ffn_stack, store_ffn_bytes
from flashllm_ext.flash.store import BIAS_ROLES, FlashStore
from flashllm_ext.runtime import cuda_device, parse_budget, tensor_bytes

FAMILY_MODELS = {"llama": LlamaModel, "opt": OPTModel, "gemma": GemmaModel}
FamilyModel = LlamaModel | OPTModel | GemmaModel
FFN = Callable[[torch.Tensor], torch.Tensor]


class LeanDecoder:
    """A decoder-only LM on the store's weights (see the module doc). Built by `load_decoder`.

    model: the family's resident part (embed, layers, logits); ffns: one callable per layer, x [T, d] -> [T, d];
    cache: the static KV cache of one sequence; runtime: the flash stack (None in dense mode)."""

    def __init__(
        self,
        store: FlashStore,
        config: DecoderConfig,
        model: FamilyModel,
        ffns: Sequence[FFN],
        cache: StaticKVCache,
        mode: str,
        runtime: FlashRuntime | None,
        model_bytes: int,
        lookahead: bool = False,
    ):
        self.store, self.config, self.model, self.ffns = store, config, model, list(ffns)
        # a module's forward called straight (the decoder registers no hooks on its FFNs): nn.Module's call wrapper
        # costs a decode token microseconds a layer
        self._ffn_calls = [ffn.forward if isinstance(ffn, nn.Module) else ffn for ffn in self.ffns]
        self.cache, self.mode, self.runtime, self.lookahead = cache, mode, runtime, lookahead
        self.tokens, self.seconds = 0, 0.0  # forwarded so far, and the wall time they took
        self.model_bytes = model_bytes  # what a percentage budget is a share of: the model's weights

    @property
    def length(self) -> int:
        """Tokens in the KV cache: the position of the next token."""
        return self.cache.length

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor | Sequence[int], all_logits: bool = False) -> torch.Tensor:
        """Run tokens ids [T] after the `length` already cached; returns float32 logits [vocab] of the last token,
        or [T, vocab] with all_logits. ValueError when the cache has no room for them."""
        ids = torch.as_tensor(ids, dtype=torch.int64).flatten()
        if ids.numel() == 0:
            raise ValueError("forward needs at least one token id")
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}), got {ids.min()}..{ids.max()}")
        self.cache.check_room(ids.numel())
        start = time.perf_counter()
        x = self.model.embed(ids.to(self.model.embedding.device), self.cache.length)
        ahead = self.lookahead and ids.numel() == 1
        rotary = self.model.rotary
        tables = None if rotary is None else rotary.tables(self.cache.length, ids.numel())
        if ahead and self.store.experts is not None:  # each layer guesses the next one's experts (pre-gating)
            self._prefetch_experts(0, x)
            for i, (layer, ffn) in enumerate(zip(self.model.layers, self._ffn_calls)):
                nxt = i + 1 if i + 1 < len(self.ffns) else None
                x = layer(
                    x, ffn, self.cache, rotary, tables, None if nxt is None else partial(self._prefetch_experts, nxt)
                )
        else:
            for layer, ffn, call in zip(self.model.layers, self.ffns, self._ffn_calls):
                if ahead:
                    ffn.prefetch(layer.ffn_input(x))
                x = layer(x, call, self.cache, rotary, tables)
        logits = self.model.logits(x if all_logits else x[-1:])
        self.cache.length += ids.numel()
        self.seconds += time.perf_counter() - start
        self.tokens += ids.numel()
        return logits if all_logits else logits[0]

    def _prefetch_experts(self, layer: int, x: torch.Tensor) -> None:
        """Start reading the experts layer `layer`'s router picks for x, an earlier layer's residual."""
        self.ffns[layer].prefetch(self.model.layers[layer].ffn_input(x))

    def prefill(self, ids: torch.Tensor | Sequence[int], chunk: int = 256) -> torch.Tensor:
        """Run a prompt in chunks of at most `chunk` tokens (bounded activation memory); logits [vocab] of its
        last token."""
        ids = torch.as_tensor(ids, dtype=torch.int64).flatten()
        self.cache.check_room(ids.numel())
        for part in ids.split(chunk):
            logits = self.forward(part)
        return logits

    def reset(self) -> None:
        """Forget the sequence: the next forward starts at position 0."""
        self.cache.reset()

    def reset_stats(self) -> None:
        """Start stats() afresh (after a prompt, say, so that they cover the decode tokens only)."""
        self.tokens, self.seconds = 0, 0.0
        if self.runtime is not None:
            self.runtime.counters.reset()

    @property
    def accounted_bytes(self) -> int:
        """DRAM the decoder holds: resident weights, RoPE tables, KV cache, and the FFN state (or dense FFNs)."""
        own = tensor_bytes(self.model.tensors()) + self.cache.nbytes
        if self.runtime is not None:
            return own + self.runtime.predictor_bytes + self.runtime.ffn_bytes
        return own + sum(ffn.nbytes for ffn in self.ffns)

    def stats(self) -> dict:
        """Per token: wall ms, and in flash modes the FFN costs of FlashRuntime.stats() with `other_ms` the rest
        (attention, resident linears, norms, Python); plus the KV cache's and the accounted bytes."""
        out = self._stats_head()
        if self.runtime is not None:
            out.update({k: v for k, v in self.runtime.stats().items() if k not in out})
            ffn = sum(out[k] for k in ("io_ms", "mem_ms", "predictor_ms", "compute_ms"))
            out["other_ms"] = out["ms_per_token"] - ffn
        out["kv_bytes"] = self.cache.nbytes
        out["accounted_bytes"] = self.accounted_bytes
        return out

    def _stats_head(self) -> dict:
        """mode, family, tokens and wall ms per token."""
        out = {"mode": self.mode, "family": self.config.model_type, "tokens": self.tokens}
        out["ms_per_token"] = self.seconds * 1e3 / max(self.tokens, 1)
        return out

    def close(self) -> None:
        """Release the reader and its threads (flash modes)."""
        if self.runtime is not None:
            self.runtime.close()
        self.store.close()


def _ffn_bias_bytes(store: FlashStore) -> int:
    biases = (store.layer_bias(layer, role) for layer in range(store.n_layers) for role in BIAS_ROLES)
    return sum(b.nbytes for b in biases if b is not None)


def load_decoder(
    store_dir: str | os.PathLike,
    dram_budget: int | float | str | None = "50%",
    *,
    mode: str = "flash",
    max_len: int = 2048,
    window: int = 5,
    predictors=None,
    dtype: torch.dtype | None = None,
    kv_dtype: torch.dtype = torch.float16,
    threads: int = 32,
    device: str | torch.device = "cpu",
    reader_options: dict | None = None,
    lookahead: str | None = None,
    cache_layout: str = "auto",
    expert_policy: str = "lru",
) -> LeanDecoder:
    """A LeanDecoder over a flash store: its resident weights in `dtype` (default the store's), its FFNs served by
    `mode` within `dram_budget` (bytes, "50%" of the model's weights, "200MB"; None: no limit; dense mode: every
    FFN weight in DRAM, no budget). max_len: the KV cache's tokens (kv_dtype), charged to the budget. Every other
    argument as in load_flash. ValueError for a model family the decoder does not run, naming it.

    A mixture-of-experts store (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) runs in dense, naive or flash mode
    (flashllm_ext.flash.experts): its routers name the experts exactly, so it needs no predictors; flash mode keeps
    experts in per-layer caches by `expert_policy` ("lru", "lfu" or "window", with `window` tokens)."""
    device = cuda_device(device)
    store = FlashStore(store_dir)
    try:
        config = DecoderConfig.from_config(store.config, store.path)
        moe = store.experts is not None
        if moe and device.type != "cpu":
            raise ValueError(f"{store.path}: a mixture-of-experts store runs on the CPU so far")
        if moe and lookahead is not None and (lookahead != "ahead" or mode != "flash"):
            raise ValueError(
                f"{store.path}: a mixture-of-experts store reads ahead in flash mode only, lookahead='ahead' "
                f"(the next layer's router on this layer's hidden state), not {lookahead!r} in {mode} mode"
            )
        cache_layout = "auto" if moe else check_lookahead(mode, lookahead, cache_layout)
        dtype = dtype or store.dtype
        predictors = None if moe else predictors_for_mode(store, predictors, mode)
        weights = ResidentWeights(store, dtype)
        model = FAMILY_MODELS[config.family](config, weights, max_len)
        if weights.left():
            raise ValueError(
                f"{store.path}: resident tensors the {config.model_type} decoder has no place for: {weights.left()[:4]}"
            )
        store.close_resident()
        model.to(device)
        cache = StaticKVCache(config.n_layers, max_len, config.n_kv_heads, config.head_dim, kv_dtype, device)
        runtime = None
        total = model_weight_bytes(model) + _ffn_bias_bytes(store) + store_ffn_bytes(store)
        budget = None if dram_budget is None else parse_budget(dram_budget, total)
        if moe:
            runtime = expert_stack(
                store,
                mode,
                budget,
                routes=[layer.router for layer in model.layers],
                top_k=config.top_k,
                shared=[layer.shared_expert for layer in model.layers],
                policy=expert_policy,
                window=window,
                threads=threads,
                resident_bytes=tensor_bytes(model.tensors()) + cache.nbytes,
                reader_options=reader_options,
            )
            ffns = runtime.modules
        elif mode == "dense":
            ffns = [ffn.to(device) for ffn in dense_ffns(store, dtype)]
        else:
            runtime = ffn_stack(
                store,
                mode,
                budget,
                window=window,
                predictors=predictors,
                threads=threads,
                resident_bytes=tensor_bytes(model.tensors()) + cache.nbytes,
                device=device,
                reader_options=reader_options,
                lookahead=lookahead or "ahead",
                cache_layout=cache_layout,
            )
            ffns = runtime.modules
    except BaseException:
        store.close()
        raise
    return LeanDecoder(store, config, model, ffns, cache, mode, runtime, total, lookahead=lookahead is not None)


def model_table_bytes(model: FamilyModel) -> int:
    """The RoPE tables' bytes (Gemma 3's local ones too): held by the decoder, not weights of the model (no part of a
    percentage budget)."""
    return sum(r.nbytes for r in (model.rotary, getattr(model, "local_rotary", None)) if r is not None)


def model_weight_bytes(model: FamilyModel) -> int:
    """The resident weights' bytes (tied ones once), without the RoPE tables."""
    return tensor_bytes(model.tensors()) - model_table_bytes(model)
