"""A Llama-family decoder on mx.arrays whose FFNs are served from a flash store: the MLX engine.

    model = flashllm_ext.mlx.load_flash(store_dir, dram_budget="50%", mode="flash")
    tokens = model.generate(prompt_ids, max_new_tokens=32); model.stats(); model.close()

The resident tensors (embeddings, attention, norms) become mx.arrays (a quantized store's blocks QuantizedArrays of
the same weights, multiplied by mlx's quantized_matmul: flashllm_ext/mlx/quantized.py); attention uses mlx's fused
RoPE, RMSNorm and scaled-dot-product attention with a key/value cache. The FFNs, by mode:
  dense   every FFN weight read once from the store into mx.arrays, computed as matrix products (the reference)
  naive   every FFN bundle re-read from the store for every forward into one staging mx.array the layers share
  hybrid  as many bundles of each layer resident in mx.arrays as the budget allows, the rest re-read every forward
          (naive and hybrid: the torch engine's StreamingFFN layers as MLXStreamingFFN, same reads and stats)
  flash   the torch engine's flash stack (flashllm_ext.flash.stack.ffn_stack: budget split, predictors, window,
          coalesced parallel reads) with MLXFlashFFN layers: the neuron caches' rows are mx.arrays
  exact   flash's caches and reads with every neuron active: dense results through the flash path
The budget is the torch engine's rule (resident tensors first, then predictors, then the caches / resident
bundles / staging), with the resident mx.arrays counted.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np
import torch

from flashllm_ext.flash.engine import predictors_for_mode
from flashllm_ext.flash.stack import FlashRuntime, ffn_stack, store_ffn_bytes
from flashllm_ext.runtime import deprecated_alias, parse_budget
from flashllm_ext.flash.ffn import store_activation
from flashllm_ext.flash.store import BIAS_ROLES, FlashStore
from flashllm_ext.flash.reader import shared_reader
from flashllm_ext.ops.blocks import QuantizedWeight
from flashllm_ext.mlx.sparse_ffn import activate
from flashllm_ext.mlx.ffn import MLXFlashFFN, MLXStreamingFFN
from flashllm_ext.mlx.quantized import QuantizedArray
from flashllm_ext.mlx.transfer import MX_DTYPE, MLXTransfer, to_mx

MODES = ("dense", "naive", "hybrid", "flash", "exact")
MODEL_TYPES = ("llama",)
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")

FFN = Callable[[mx.array], mx.array]


class DenseFFN:
    """One GLU FFN layer from its store bundles, held as mx.arrays: down(act(gate x) * up x)."""

    def __init__(self, bundles: torch.Tensor, hidden_size: int, activation: str):
        d = hidden_size
        self.up, self.gate, self.down = (
            to_mx(part) for part in (bundles[:, :d], bundles[:, d : 2 * d], bundles[:, -d:])
        )
        self.activation = activation

    def __call__(self, x: mx.array) -> mx.array:
        return (activate(x @ self.gate.T, self.activation) * (x @ self.up.T)) @ self.down


class MLXLlama:
    """A Llama-family causal LM on mx.arrays (see the module doc). Built by `load_flash`.

    weights: resident tensors by name without the leading "model." (embed_tokens.weight, layers.{i}.self_attn.
    q_proj.weight, ..., norm.weight, lm_head.weight when not tied), mx.arrays or QuantizedArrays; ffns: one callable
    per layer, x [T, d] -> [T, d];
    runtime: the flash stack (None in dense mode)."""

    def __init__(
        self,
        store: FlashStore,
        weights: dict[str, mx.array],
        ffns: Sequence[FFN],
        mode: str,
        runtime: FlashRuntime | None,
    ):
        config = store.config
        self.store, self.mode, self.runtime, self.ffns = store, mode, runtime, list(ffns)
        self.n_layers, self.hidden_size = store.n_layers, store.hidden_size
        self.n_heads = int(config["num_attention_heads"])
        self.n_kv_heads = int(config.get("num_key_value_heads") or self.n_heads)
        self.head_dim = int(config.get("head_dim") or self.hidden_size // self.n_heads)
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.rope_base = float(config.get("rope_theta", 10000.0))
        self.vocab_size = int(config["vocab_size"])
        self.w = weights
        self.lm_head = weights.get("lm_head.weight", weights["embed_tokens.weight"])
        self.tokens = 0  # positions run through the model
        self.prefill_s = self.decode_s = 0.0
        self.decode_tokens = 0

    def _linear(self, x: mx.array, name: str) -> mx.array:
        y = _product(x, self.w[f"{name}.weight"])
        bias = self.w.get(f"{name}.bias")
        return y if bias is None else y + bias

    def _attention(self, layer: int, x: mx.array, kv: list, offset: int) -> mx.array:
        """Self-attention of x [T, d] at positions offset.., appending to the layer's key/value cache kv[layer]."""
        prefix, t = f"layers.{layer}.self_attn", x.shape[0]

        def heads(name: str, n: int) -> mx.array:  # [1, n, T, head_dim]
            return self._linear(x, f"{prefix}.{name}").reshape(1, t, n, self.head_dim).transpose(0, 2, 1, 3)

        def rope(a: mx.array) -> mx.array:  # Llama's RoPE rotates the two halves of each head (not interleaved)
            return mx.fast.rope(a, self.head_dim, traditional=False, base=self.rope_base, scale=1.0, offset=offset)

        q, k, v = (
            rope(heads("q_proj", self.n_heads)),
            rope(heads("k_proj", self.n_kv_heads)),
            heads("v_proj", self.n_kv_heads),
        )
        if kv[layer] is not None:
            k, v = mx.concatenate([kv[layer][0], k], axis=2), mx.concatenate([kv[layer][1], v], axis=2)
        kv[layer] = (k, v)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5, mask="causal" if t > 1 else None)
        return self._linear(out.transpose(0, 2, 1, 3).reshape(t, -1), f"{prefix}.o_proj")

    def forward(self, ids: mx.array, kv: list, offset: int) -> mx.array:
        """Logits [vocab] of the last of the tokens ids [T] at positions offset.. (kv: per layer (keys, values) or
        None, extended in place)."""
        table = self.w["embed_tokens.weight"]
        h = table.rows(ids, self.w["norm.weight"].dtype) if isinstance(table, QuantizedArray) else table[ids]
        for i in range(self.n_layers):
            prefix = f"layers.{i}"
            h = h + self._attention(
                i, mx.fast.rms_norm(h, self.w[f"{prefix}.input_layernorm.weight"], self.eps), kv, offset
            )
            h = h + self.ffns[i](mx.fast.rms_norm(h, self.w[f"{prefix}.post_attention_layernorm.weight"], self.eps))
        self.tokens += ids.size
        return _product(mx.fast.rms_norm(h[-1:], self.w["norm.weight"], self.eps), self.lm_head)[0]

    def generate(
        self, prompt_ids: Sequence[int] | np.ndarray | torch.Tensor | mx.array, max_new_tokens: int
    ) -> list[int]:
        """Greedy continuation: the prompt's ids followed by `max_new_tokens` generated ids (an end-of-sequence token
        does not stop it). prompt_ids: token ids [T] or [1, T]."""
        ids = self._check_prompt(prompt_ids)
        return ids + self._greedy(ids, max_new_tokens)

    def greedy_decode(
        self, prompt_ids: Sequence[int] | np.ndarray | torch.Tensor | mx.array, n_tokens: int
    ) -> tuple[list[int], float]:
        """(the `n_tokens` generated ids, decode seconds per token), as flashllm_ext.demos.flash.greedy_decode does
        for a torch model: the stats are reset after the prompt, so stats() then covers the decode tokens."""
        new = self._greedy(self._check_prompt(prompt_ids), n_tokens, after_prompt=self.reset_stats)
        return new, self.decode_s / max(1, self.decode_tokens)

    def _greedy(self, ids: list[int], n_tokens: int, after_prompt: Callable[[], None] | None = None) -> list[int]:
        if not isinstance(n_tokens, int) or n_tokens < 0:
            raise ValueError(f"the number of new tokens must be a non-negative int, got {n_tokens!r}")
        if n_tokens == 0:
            return []
        kv: list = [None] * self.n_layers
        start = time.perf_counter()
        new = [int(mx.argmax(self.forward(mx.array(ids), kv, 0)).item())]
        self.prefill_s += time.perf_counter() - start
        if after_prompt is not None:
            after_prompt()
        start = time.perf_counter()
        for _ in range(n_tokens - 1):
            new.append(int(mx.argmax(self.forward(mx.array(new[-1:]), kv, len(ids) + len(new) - 1)).item()))
        self.decode_s += time.perf_counter() - start
        self.decode_tokens += n_tokens - 1
        return new

    def _check_prompt(self, prompt_ids) -> list[int]:
        array = np.asarray(prompt_ids.tolist() if isinstance(prompt_ids, (torch.Tensor, mx.array)) else prompt_ids)
        if array.ndim == 2 and array.shape[0] == 1:
            array = array[0]
        if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(
                f"prompt_ids must be a non-empty sequence of integer token ids ([T] or [1, T]), got "
                f"{array.dtype} of shape {array.shape}"
            )
        if array.min() < 0 or array.max() >= self.vocab_size:
            raise ValueError(
                f"token ids must lie in [0, vocab_size={self.vocab_size}), got min {array.min()} max {array.max()}"
            )
        return array.tolist()

    def stats(self) -> dict:
        """The torch engine's per-token breakdown (FlashRuntime.stats; dense mode: the mode and token count
        only), plus the wall time of generate(): prefill milliseconds and decode milliseconds per token."""
        stats = self.runtime.stats() if self.runtime is not None else {"mode": self.mode, "tokens": self.tokens}
        return {
            **stats,
            "prefill_ms": self.prefill_s * 1e3,
            "decode_ms_per_token": self.decode_s * 1e3 / max(1, self.decode_tokens),
        }

    flash_stats = deprecated_alias(stats, "MLXLlama.flash_stats()", "MLXLlama.stats()")

    def reset_stats(self) -> None:
        """Zero the counters stats() reports (the caches keep their rows)."""
        self.tokens, self.prefill_s, self.decode_s, self.decode_tokens = 0, 0.0, 0.0, 0
        if self.runtime is not None:
            self.runtime.counters.reset()

    def close(self) -> None:
        """Release the flash stack's reader (its threads and file)."""
        if self.runtime is not None:
            self.runtime.close()


def _product(x: mx.array, weight: mx.array | QuantizedArray) -> mx.array:
    """x [T, cols] @ weight^T, the weight [rows, cols] held as floats or as the store's blocks."""
    return weight.matmul_t(x) if isinstance(weight, QuantizedArray) else x @ weight.T


def _check_llama(store: FlashStore) -> None:
    config = store.config
    if config.get("model_type") not in MODEL_TYPES:
        raise ValueError(
            f"{store.path}: the MLX decoder runs the Llama family ({MODEL_TYPES}), the store holds a "
            f"{config.get('model_type')!r} model (use flashllm_ext.load_flash, the torch engine)"
        )
    scaling = config.get("rope_scaling")
    if scaling and (scaling.get("rope_type") or scaling.get("type")) not in (None, "default"):
        raise ValueError(f"{store.path}: rope_scaling {scaling} is not supported by the MLX decoder")
    if not store.glu or store.endor:
        raise ValueError(
            f"{store.path}: the MLX decoder needs a dense GLU store (glu={store.glu}, endor={store.endor})"
        )
    if any(role in roles for roles in store.ffn_roles for role in BIAS_ROLES):
        raise ValueError(f"{store.path}: FFN biases (mlp_bias) are not supported by the MLX decoder")


def _resident_arrays(store: FlashStore, dtype: torch.dtype) -> dict[str, mx.array | QuantizedArray]:
    """The store's resident tensors (predictors excepted) as mx.arrays of `dtype`, those held as blocks
    (resident_formats: a quantized store's attention, embedding, LM head) as QuantizedArrays of the same bytes,
    named without "model."."""
    weights = {}
    for name in store.resident_names():
        if name.startswith("predictor."):
            continue
        weight = store.resident_weight(name)
        weights[name.removeprefix("model.")] = (
            QuantizedArray.from_blocks(weight, MX_DTYPE[dtype])
            if isinstance(weight, QuantizedWeight)
            else to_mx(weight.to(dtype))
        )
    tied = bool(store.config.get("tie_word_embeddings", False))  # (transformers' default for Llama: untied)
    needed = (
        ["embed_tokens.weight", "norm.weight"]
        + ([] if tied else ["lm_head.weight"])
        + [
            f"layers.{i}.{part}.weight"
            for i in range(store.n_layers)
            for part in ("input_layernorm", "post_attention_layernorm", *(f"self_attn.{p}" for p in _ATTENTION))
        ]
    )
    missing = [name for name in needed if name not in weights]
    if missing:
        raise ValueError(f"{store.path}: the store has no resident tensor for {missing[:3]} ({len(missing)} in all)")
    return weights


def load_flash(
    store_dir: str | os.PathLike,
    dram_budget: int | float | str | None = "50%",
    *,
    mode: str = "flash",
    window: int = 5,
    predictors=None,
    dtype: torch.dtype | None = None,
    threads: int = 32,
    reader_options: dict | None = None,
    cache_layout: str = "auto",
) -> MLXLlama:
    """The MLX engine: a Llama-family model from a flash store on mx.arrays, its FFNs served by `mode` (MODES)
    within `dram_budget` (bytes, "50%" of the model, "200MB"; None: no limit; dense mode holds everything and
    ignores it). dtype: of the resident tensors and the activations (default: the store's), and of dense mode's FFN
    weights; the other modes' FFNs compute in the store's dtype. Predictors come from the store unless given. threads
    and reader_options: the FlashReader's. cache_layout: flash and exact mode's (the torch engine's CACHE_LAYOUTS).
    Raises ValueError for another model family, a budget below the minimum (naming it), or flash mode without
    predictors."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    store = FlashStore(store_dir)
    _check_llama(store)
    dtype = dtype or store.dtype
    if dtype not in MX_DTYPE or not dtype.is_floating_point:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    predictors = predictors_for_mode(store, predictors, mode)
    weights = _resident_arrays(store, dtype)
    if mode == "dense":
        activation = store_activation(store)
        with shared_reader(store) as reader:
            ffns = [
                DenseFFN(
                    store.float_rows(reader.read(i, torch.arange(store.n_neurons)).data).to(dtype),
                    store.hidden_size,
                    activation,
                )
                for i in range(store.n_layers)
            ]
        return MLXLlama(store, weights, ffns, mode, None)
    resident_bytes = sum(a.nbytes for a in weights.values())
    budget = None if dram_budget is None else parse_budget(dram_budget, resident_bytes + store_ffn_bytes(store))
    runtime = ffn_stack(
        store,
        mode,
        budget,
        window=window,
        predictors=predictors,
        threads=threads,
        resident_bytes=resident_bytes,
        transfer=MLXTransfer(),
        reader_options=reader_options,
        ffn_class=MLXFlashFFN,
        streaming_class=MLXStreamingFFN,
        cache_layout=cache_layout,
    )
    return MLXLlama(store, weights, runtime.modules, mode, runtime)
