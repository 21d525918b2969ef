"""What the lean decoder reads of a model's config (a store's config.json fields), one frozen record for every
family it runs. A family it does not know is refused here, naming it, before any weight is read."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from flashllm_ext.ops import config_activation

# model_type -> the decoder family that runs it (flashllm_ext/decoder/<family>.py)
FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "opt": "opt"}
# the mixture-of-experts families: a Llama-family attention, experts and a router in place of the FFN
FAMILIES.update({"mixtral": "llama", "qwen2_moe": "llama", "qwen3_moe": "llama", "olmoe": "llama"})
# Gemma 2 and 3 (text): GeGLU, sandwich norms, scaled embeddings, soft-capped logits, local and global layers
FAMILIES.update({"gemma2": "gemma", "gemma3_text": "gemma"})
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class DecoderConfig:
    """A decoder-only transformer's shape and variant flags. Per-layer attention windows: `windows[i]` keys at most
    (Mistral's and Qwen's sliding window), None for full attention."""

    model_type: str
    family: str
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    norm_eps: float
    max_positions: int
    tie_embeddings: bool
    qkv_bias: bool  # Qwen2 (always), Llama's attention_bias
    o_bias: bool  # Llama's attention_bias, OPT
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    windows: tuple[int | None, ...]
    rope_theta: float
    rope_scaling: dict | None
    norm_before: bool = True  # OPT's do_layer_norm_before (False: OPT-350m's post-norm layers)
    word_embed_dim: int | None = None  # OPT's word_embed_proj_dim when it differs from hidden_size
    full_qk_norm: bool = False  # OLMoE: one RMSNorm over all of q's heads (and one over k's) before RoPE
    n_experts: int = 0  # experts per layer (0: a dense FFN)
    top_k: int = 0  # experts a token uses per layer
    norm_top_k: bool = False  # the chosen experts' router probabilities renormalised to sum to 1
    shared_expert: bool = False  # Qwen2-MoE: a dense expert every token uses, scaled by a sigmoid gate
    hidden_act: str = "silu"  # an ops.ACTIVATIONS key: the shared expert's (the FFN modules read the store's)
    attention_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attention_softcap: float | None = None  # Gemma 2: attention logits s -> cap * tanh(s / cap)
    logit_softcap: float | None = None  # Gemma 2: the LM head's logits capped the same way
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base (unscaled)

    @classmethod
    def from_config(cls, config: dict, source: str | os.PathLike) -> DecoderConfig:
        """The record of a Hugging Face config dict; ValueError naming `source` for a family or a RoPE variant the
        decoder does not run."""
        model_type = config.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(
                f"{source}: the lean decoder does not run model_type {model_type!r} (it runs {sorted(FAMILIES)}); "
                "load it with load_flash (flashllm run --hf) to run it through transformers"
            )
        family = FAMILIES[model_type]
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        layers = int(config["num_hidden_layers"])
        if family == "opt":
            word_dim = int(config.get("word_embed_proj_dim") or hidden)
            return cls(
                model_type=model_type,
                family=family,
                hidden_size=hidden,
                n_layers=layers,
                n_heads=heads,
                n_kv_heads=heads,
                head_dim=hidden // heads,
                vocab_size=int(config["vocab_size"]),
                norm_eps=1e-5,
                max_positions=int(config["max_position_embeddings"]),
                tie_embeddings=bool(config.get("tie_word_embeddings", True)),
                qkv_bias=bool(config.get("enable_bias", True)),
                o_bias=bool(config.get("enable_bias", True)),
                qk_norm=False,
                windows=(None,) * layers,
                rope_theta=0.0,
                rope_scaling=None,
                norm_before=bool(config.get("do_layer_norm_before", True)),
                word_embed_dim=None if word_dim == hidden else word_dim,
            )
        # transformers 5 writes rope_parameters (rope_theta inside; Gemma 3's per layer type); older configs
        # rope_scaling beside rope_theta (Gemma 3's sliding layers: rope_local_base_freq).
        scaling = config.get("rope_parameters") or config.get("rope_scaling") or {}
        local_theta = config.get("rope_local_base_freq") if model_type == "gemma3_text" else None
        if "full_attention" in scaling:
            local = scaling.get("sliding_attention") or {}
            if (local.get("rope_type") or "default") != "default":
                raise ValueError(f"{source}: sliding layers' rope_type {local['rope_type']!r} is not supported")
            local_theta, scaling = local.get("rope_theta"), scaling["full_attention"]
        rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{source}: rope_scaling type {rope_type!r} is not supported (one of {ROPE_TYPES})")
        gemma = family == "gemma"
        try:
            hidden_act = config_activation(config)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
        if config.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{source}: partial_rotary_factor {config['partial_rotary_factor']} is not supported")
        if config.get("clip_qkv") is not None:
            raise ValueError(f"{source}: clip_qkv {config['clip_qkv']} is not supported")
        n_experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
        return cls(
            model_type=model_type,
            family=family,
            hidden_size=hidden,
            n_layers=layers,
            n_heads=heads,
            n_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_positions=int(config.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(config.get("tie_word_embeddings", gemma)),
            qkv_bias=model_type in ("qwen2", "qwen2_moe") or bool(config.get("attention_bias", False)),
            o_bias=model_type not in ("qwen2", "qwen2_moe") and bool(config.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            windows=_windows(config, model_type, layers),
            rope_theta=float(scaling.get("rope_theta") or config.get("rope_theta", 10000.0)),
            rope_scaling=None if rope_type == "default" else dict(scaling),
            full_qk_norm=model_type == "olmoe",
            n_experts=n_experts,
            top_k=int(config.get("num_experts_per_tok") or 0) if n_experts else 0,
            # Mixtral always renormalises; the others as their config says
            norm_top_k=model_type == "mixtral" or bool(config.get("norm_topk_prob", False)),
            shared_expert=bool(config.get("shared_expert_intermediate_size")),
            hidden_act=hidden_act,
            attention_scale=float(config["query_pre_attn_scalar"]) ** -0.5 if gemma else None,
            attention_softcap=config.get("attn_logit_softcapping") if gemma else None,
            logit_softcap=config.get("final_logit_softcapping") if gemma else None,
            local_rope_theta=None if local_theta is None else float(local_theta),
        )


def _windows(config: dict, model_type: str, n_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding attention window: config `layer_types` where given (newer configs), else Mistral's
    sliding_window on every layer, Qwen's on the layers from max_window_layers when use_sliding_window is set, and
    Gemma's on its local layers."""
    window = config.get("sliding_window")
    if not window:
        return (None,) * n_layers
    if config.get("layer_types"):
        return tuple(int(window) if kind == "sliding_attention" else None for kind in config["layer_types"])
    if model_type in ("mistral", "mixtral"):
        return (int(window),) * n_layers
    if model_type == "gemma2":  # configs before layer_types: the even layers slide
        return tuple(int(window) if i % 2 == 0 else None for i in range(n_layers))
    if model_type == "gemma3_text":  # every sliding_window_pattern-th layer global
        pattern = int(config.get("sliding_window_pattern", 6))
        return tuple(int(window) if (i + 1) % pattern else None for i in range(n_layers))
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and config.get("use_sliding_window"):
        first = int(config.get("max_window_layers", n_layers))
        return tuple(int(window) if i >= first else None for i in range(n_layers))
    return (None,) * n_layers


def rope_inverse_frequencies(config: DecoderConfig, local: bool = False) -> torch.Tensor:
    """float32 [head_dim / 2]: RoPE's per-pair rotation speeds, with the config's scaling (linear, or Llama 3's
    frequency-dependent one) applied as transformers applies it; `local`: Gemma 3's sliding layers' (unscaled)."""
    dim = config.head_dim
    theta = config.local_rope_theta if local else config.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None or local:
        return inv
    factor = float(scaling["factor"])
    if (scaling.get("rope_type") or scaling.get("type")) == "linear":
        return inv / factor
    # Llama 3: long wavelengths slowed by `factor`, short ones kept, the band between interpolated.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv
    scaled = torch.where(wavelength > original / low, inv / factor, inv)
    smooth = (original / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(medium, smoothed, scaled)
