"""Tiny random transformers models: Llama and its relatives (GLU FFN, grouped-query attention), Gemma 2 and 3, OPT
(ReLU FFN with biases) and the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE); comparing greedy
tokens across a near tie."""

from collections.abc import Callable

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

# tiny_model's defaults; every other field is transformers' default. A Llama has no learned position table, so its
# max_position_embeddings stays transformers' 2048 unless given; an OPT's is a table, kept small, and its word
# embeddings are hidden_size wide unless given.
LLAMA = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)
OPT = dict(
    hidden_size=48,
    ffn_dim=136,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=100,
    max_position_embeddings=64,
)
# The Llama of the tiny_llama fixture (tests/conftest.py), which tests/io/test_checkpoint.py also writes as a GGUF.
TINY_LLAMA = dict(
    LLAMA,
    intermediate_size=96,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)

# The Llama relatives share its defaults: Qwen2 adds q/k/v biases, Qwen3 per-head q/k norms, Mistral a sliding
# window (off unless sliding_window is given).
_FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, LLAMA),
    "opt": (OPTConfig, OPTForCausalLM, OPT),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, LLAMA),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(LLAMA, head_dim=16)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(LLAMA, sliding_window=None)),
    # Gemma's weights drawn wider than transformers' 0.02: its scaled, tied embedding otherwise makes every
    # layer's contribution too small to change a token.
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, dict(LLAMA, head_dim=16, initializer_range=0.1)),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(LLAMA, head_dim=16, initializer_range=0.1)),
}
# The mixture-of-experts families: 8 experts of 48 neurons, 2 a token (Mixtral's experts are intermediate_size
# wide); Qwen2-MoE adds a shared expert, Qwen3-MoE per-head q/k norms, OLMoE q/k norms over all heads.
MOE = dict(LLAMA, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48)
_FAMILIES.update(
    {
        "mixtral": (MixtralConfig, MixtralForCausalLM, dict(LLAMA, num_local_experts=8, intermediate_size=48)),
        "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(MOE, shared_expert_intermediate_size=80)),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(MOE, head_dim=16, norm_topk_prob=True)),
        "olmoe": (
            OlmoeConfig,
            OlmoeForCausalLM,
            dict(LLAMA, num_experts=8, num_experts_per_tok=2, intermediate_size=48, num_key_value_heads=4),
        ),
    }
)


def tiny_model(family: str, seed: int | None = 0, **config) -> torch.nn.Module:
    """A random causal LM of `family` (a key of _FAMILIES) in eval mode: the family's defaults above, any of them or
    any other config field replaced by keyword. Its weights are drawn after torch.manual_seed(seed); seed=None draws
    them from the random state as the caller left it (a second model after a first, from one seed)."""
    if family not in _FAMILIES:
        raise ValueError(f"unknown family {family!r}: one of {sorted(_FAMILIES)}")
    config_class, model_class, defaults = _FAMILIES[family]
    fields = {**defaults, **config}
    if family == "opt":
        fields.setdefault("word_embed_proj_dim", fields["hidden_size"])
    if seed is not None:
        torch.manual_seed(seed)
    return model_class(config_class(**fields)).eval()


def assert_tokens_agree(
    got: list[int], want: list[int], reference_logits: Callable[[list[int]], torch.Tensor], tol: float
) -> None:
    """Greedy token sequences `got` and the reference's `want` are equal, or part where the reference's two
    candidates were within `tol` of its largest logit of each other: a near tie that a rounding (x to int8 per
    block, as quantized linears do) may settle either way. reference_logits(ids) -> its logits [vocab] after ids."""
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if at is None:
        assert len(got) == len(want)
        return
    logits = reference_logits(want[:at]).float()
    margin = float(logits[want[at]] - logits[got[at]])
    assert margin <= tol * float(logits.abs().max()), f"tokens part at {at}, the reference's margin {margin}"
