// Argument checks of flashllm::decoder_attention (CPU kernel; other devices run the reference);
// flashllm_ext/ops/decoder.py makes the same checks for the reference and fake kernels, with the same words.
#pragma once
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "common/quantized_ffn_checks.h"

namespace flashllm {

// The heads of one decoder_attention call: Hq query heads and Hkv kv heads of head_dim D.
struct DecoderHeads {
  int64_t n_q, n_kv, head_dim;
};

inline bool is_decoder_weight_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// A projection weight's format: -1 without one (floats), else its block format.
inline int decoder_weight_format(const std::optional<c10::string_view>& format, const char* name) {
  if (!format) return -1;
  const int code = parse_block_format(std::string(*format));
  TORCH_CHECK(code >= 0, "decoder_attention: ", name, " must be one of ('q8_0', 'q4_0', 'q4_1') or None, got '",
              std::string(*format), "'");
  return code;
}

// Whether w holds `cols` columns as the format says: floats [., cols], or contiguous uint8 rows of cols' blocks.
inline bool is_decoder_weight(const at::Tensor& w, int format, int64_t cols) {
  if (format < 0) return w.dim() == 2 && is_decoder_weight_dtype(w.scalar_type()) && w.size(1) == cols;
  return w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() &&
         w.size(1) == (cols + kBlock - 1) / kBlock * block_bytes(format);
}

inline std::string decoder_weight_kind(int format, const std::optional<c10::string_view>& name) {
  return format < 0 ? "a float tensor" : "uint8 rows of " + std::string(*name) + " blocks";
}

inline DecoderHeads check_decoder_attention_args(
    const at::Tensor& x, const at::Tensor& norm_weight, const at::Tensor& qkv_weight,
    const std::optional<at::Tensor>& qkv_bias, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
    const at::Tensor& v_cache, const at::Tensor& o_weight, const std::optional<at::Tensor>& o_bias,
    const at::Tensor& ffn_norm_weight, int64_t position, const std::optional<c10::string_view>& qkv_format_name,
    const std::optional<c10::string_view>& o_format_name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(0) == 1,
              "decoder_attention: x must be a float32 tensor [1, d], got ", x.scalar_type(), " of shape ", x.sizes());
  const int64_t d = x.size(1);
  TORCH_CHECK(
      k_cache.dim() == 4 && k_cache.size(1) == 1 && k_cache.sizes() == v_cache.sizes() &&
          k_cache.scalar_type() == v_cache.scalar_type() && is_decoder_weight_dtype(k_cache.scalar_type()),
      "decoder_attention: k_cache and v_cache must be float tensors [S, 1, Hkv, D] of one shape and dtype, got ",
      k_cache.scalar_type(), " ", k_cache.sizes(), " and ", v_cache.scalar_type(), " ", v_cache.sizes());
  const int64_t n_kv = k_cache.size(2), head_dim = k_cache.size(3);
  const int qkv_format = decoder_weight_format(qkv_format_name, "qkv_format");
  const int o_format = decoder_weight_format(o_format_name, "o_format");
  const int64_t rows = qkv_weight.dim() == 2 ? qkv_weight.size(0) : -1;
  const int64_t n_q = head_dim ? (rows - 2 * n_kv * head_dim) / head_dim : 0;
  TORCH_CHECK(is_decoder_weight(qkv_weight, qkv_format, d) && n_q >= n_kv && n_kv >= 1 && n_q % n_kv == 0 &&
                  rows == (n_q + 2 * n_kv) * head_dim,
              "decoder_attention: qkv_weight must be ", decoder_weight_kind(qkv_format, qkv_format_name),
              " [(Hq + 2 Hkv) D, d=", d, "] with Hq a multiple of Hkv=", n_kv, " and D=", head_dim, ", got ",
              qkv_weight.scalar_type(), " of shape ", qkv_weight.sizes());
  // Float weights are one dtype (their biases too); a bias of rows of blocks is float32.
  const bool floats = qkv_format < 0 && o_format < 0;
  const bool o_dtype = !floats || o_weight.scalar_type() == qkv_weight.scalar_type();
  TORCH_CHECK(is_decoder_weight(o_weight, o_format, n_q * head_dim) && o_dtype && o_weight.size(0) == d,
              "decoder_attention: o_weight must be ",
              floats ? c10::str(qkv_weight.scalar_type()) : decoder_weight_kind(o_format, o_format_name), " [d=", d,
              ", Hq D=", n_q * head_dim, "], got ", o_weight.scalar_type(), " of shape ", o_weight.sizes());
  const char* bias_names[2] = {"qkv_bias", "o_bias"};
  const std::optional<at::Tensor>* biases[2] = {&qkv_bias, &o_bias};
  const int64_t bias_sizes[2] = {rows, d};
  const at::ScalarType bias_dtypes[2] = {qkv_format < 0 ? qkv_weight.scalar_type() : at::kFloat,
                                         o_format < 0 ? o_weight.scalar_type() : at::kFloat};
  for (int i = 0; i < 2; ++i) {
    const auto& b = *biases[i];
    TORCH_CHECK(!b || (b->scalar_type() == bias_dtypes[i] && b->dim() == 1 && b->size(0) == bias_sizes[i]),
                "decoder_attention: ", bias_names[i], " must be ", bias_dtypes[i], " [", bias_sizes[i], "], got ",
                b ? b->scalar_type() : bias_dtypes[i], " of shape ", b ? b->sizes() : at::IntArrayRef{});
  }
  const char* vec_names[6] = {"norm_weight", "ffn_norm_weight", "q_norm", "k_norm", "cos", "sin"};
  const at::Tensor* vecs[6] = {
      &norm_weight, &ffn_norm_weight, q_norm ? &*q_norm : nullptr, k_norm ? &*k_norm : nullptr, &cos, &sin};
  const int64_t vec_sizes[6] = {d, d, head_dim, head_dim, head_dim, head_dim};
  for (int i = 0; i < 6; ++i) {
    const at::Tensor* v = vecs[i];
    TORCH_CHECK(!v || (v->scalar_type() == at::kFloat && v->dim() == 1 && v->size(0) == vec_sizes[i]),
                "decoder_attention: ", vec_names[i], " must be float32 [", vec_sizes[i], "], got ",
                v ? v->scalar_type() : at::kFloat, " of shape ", v ? v->sizes() : at::IntArrayRef{});
  }
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "decoder_attention: give both q_norm and k_norm or neither");
  TORCH_CHECK(head_dim % 2 == 0, "decoder_attention: the head size D=", head_dim, " must be even (RoPE pairs halves)");
  TORCH_CHECK(position >= 0 && position < k_cache.size(0), "decoder_attention: position ", position,
              " is outside the cache's ", k_cache.size(0), " tokens");
  const at::Tensor* all[12] = {
      &norm_weight, &qkv_weight, qkv_bias ? &*qkv_bias : nullptr, vecs[2],         vecs[3], &cos, &sin, &k_cache,
      &v_cache,     &o_weight,   o_bias ? &*o_bias : nullptr,     &ffn_norm_weight};
  for (const at::Tensor* t : all) {
    TORCH_CHECK(!t || t->device() == x.device(), "decoder_attention: every tensor must be on x's device ", x.device());
  }
  return {n_q, n_kv, head_dim};
}

}  // namespace flashllm
