"""The flashllm ops: one file per op family (endor, ffn, cache, quant, linear, attention), each holding its ops'
schemas, checks, pure-torch reference and fake kernels, and the typed wrapper library code calls them through.

Importing this package registers every schema of `torch.ops.flashllm` with its reference kernel, then loads the native
library (`native`: CPU kernels, and CUDA kernels when built with CUDA), which overrides them per dispatch key. The
typed wrappers take the tensors first and every other argument as a keyword. Shapes in their docstrings use T tokens,
d hidden size, R rows, C cache capacity, N neurons; for attention B sequences, S keys per sequence, Hq query heads,
Hkv kv heads, D head size, P partial results.
"""

from __future__ import annotations

from flashllm_ext.ops.endor import (
    ENDOR_DTYPES,
    ENDOR_LINEAR_DTYPES,
    check_endor_args,
    endor_decompress,
    endor_decompress_reference,
    endor_linear,
    endor_linear_reference,
)
from flashllm_ext.ops.ffn import (
    ACTIVATIONS,
    Activation,
    FFN_DTYPES,
    check_sparse_ffn_args,
    config_activation,
    quantized_sparse_ffn,
    quantized_sparse_ffn_reference,
    sparse_ffn,
    sparse_ffn_reference,
)
from flashllm_ext.ops.cache import (
    cache_compact,
    cache_compact_reference,
    cache_plan,
    cache_plan_reference,
    check_cache_compact_args,
    compaction_moves,
)
from flashllm_ext.ops.quant import (
    QUANT_BITS,
    QUANT_GROUP_MULTIPLE,
    QUANT_MAX_COLUMNS,
    dequantize_rows,
    quant_scores,
    quant_scores_reference,
    round_x_int8,
    unpack_codes,
)
from flashllm_ext.ops.linear import (
    half_linear,
    half_linear_reference,
    quantized_linear,
    quantized_linear_reference,
    quantized_matmul,
)
from flashllm_ext.ops.attention import (
    ATTENTION_DTYPES,
    decode_attention,
    decode_attention_reference,
    merge_attention_states,
    merge_attention_states_reference,
)
from flashllm_ext.ops.decoder import decoder_attention, decoder_attention_reference
from flashllm_ext.ops.native import native_available, require_native  # after the schemas: loads _C

__all__ = [
    "cache_compact",
    "cache_plan",
    "decode_attention",
    "decoder_attention",
    "endor_decompress",
    "endor_linear",
    "half_linear",
    "merge_attention_states",
    "quant_scores",
    "quantized_linear",
    "quantized_sparse_ffn",
    "sparse_ffn",
]
