// The CPU decode attention over raw buffers, for kernels that call it between other steps of a token
// (decoder_attention) without building, converting and zeroing tensors for flashllm::decode_attention's dispatch.
#pragma once

#include <ATen/ATen.h>

#include "common/decode_attention_checks.h"

namespace flashllm {

// out [B, Hq, D] and lse [B, Hq] (float32, any prior contents) <- the attention of q (float32 [B, Hq, D], contiguous,
// already multiplied by the scale) over k and v [S, B, Hkv, D] (k's dtype, any strides), as flashllm::decode_attention
// computes it.
void decode_attention_scaled(const AttentionShape& shape, const float* q, const at::Tensor& k, const at::Tensor& v,
                             float* out, float* lse);

}  // namespace flashllm
