// flashllm::decoder_attention on the CPU: the attention half of a Llama-family decoder layer for one decode token in
// one call, so a token pays one dispatch per layer for it instead of a dozen small tensor ops (each a few
// microseconds of framework time against ~60 us of weight reads at 135M shapes).
//
// The two matrix products are the library's own ops (flashllm::half_linear on float weights, at the read bound, or
// flashllm::quantized_linear on rows of blocks), called through the dispatcher; the attention is the CPU
// decode_attention's loop on the cache in place (decode_attention_scaled: no tensors to build, convert or zero for
// it); the norms, the per-head q/k norms, RoPE, the cache writes and the residual are plain loops over a few hundred
// floats between them.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "common/decoder_attention_checks.h"
#include "cpu/decode_attention.h"

namespace flashllm {
namespace {

// out[i] = x[i] * w[i] / sqrt(mean(x^2) + eps), i < n
void rms_norm(const float* x, const float* w, int64_t n, double eps, float* out) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += double(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(sum / double(n) + eps));
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

// Head at v [D] rotated in place: v * cos + swap_halves(v) * sin (sin signed, see the schema).
void rotate(float* v, const float* cos, const float* sin, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cos[i] + b * sin[i];
    v[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

at::Tensor half_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("flashllm::half_linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
  return op.call(x, w, b);
}

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& w, c10::string_view format,
                            const std::optional<at::Tensor>& b) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("flashllm::quantized_linear", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view,
                                               const std::optional<at::Tensor>&)>();
  return op.call(x, w, format, b);
}

// x [1, in] float32 times a projection weight: floats, or rows of blocks in `format`.
at::Tensor project(const at::Tensor& x, const at::Tensor& w, const std::optional<c10::string_view>& format,
                   const std::optional<at::Tensor>& b) {
  return format ? quantized_linear(x, w, *format, b) : half_linear(x, w, b);
}

// The cache's element type as a C++ type: f(T{}) for float32, float16 or bfloat16 (the checks admit no other).
template <class F>
void with_cache_type(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat:
      f(float{});
      break;
    case at::kHalf:
      f(c10::Half{});
      break;
    default:
      f(c10::BFloat16{});
  }
}

// The new token's k and v heads ([Hkv, D] each, float32) stored at `position` of the caches [S, 1, Hkv, D], and q
// ([Hq, D]) rounded to the cache's type and multiplied by the scale into q_scaled: what copying k and v into the
// caches and running flashllm::decode_attention on q in the cache's dtype would do, without a tensor for each step.
template <class T>
void store_token(const float* q, const float* k, const float* v, const DecoderHeads& heads, at::Tensor& k_cache,
                 at::Tensor& v_cache, int64_t position, float scale, float* q_scaled) {
  const int64_t D = heads.head_dim;
  for (int64_t i = 0; i < heads.n_q * D; ++i) q_scaled[i] = static_cast<float>(static_cast<T>(q[i])) * scale;
  const float* sources[2] = {k, v};
  at::Tensor* caches[2] = {&k_cache, &v_cache};
  for (int c = 0; c < 2; ++c) {
    T* row = static_cast<T*>(caches[c]->data_ptr()) + position * caches[c]->stride(0);
    const int64_t head_stride = caches[c]->stride(2), elem_stride = caches[c]->stride(3);
    for (int64_t h = 0; h < heads.n_kv; ++h)
      for (int64_t e = 0; e < D; ++e) row[h * head_stride + e * elem_stride] = static_cast<T>(sources[c][h * D + e]);
  }
}

std::tuple<at::Tensor, at::Tensor> decoder_attention_cpu(
    const at::Tensor& x_in, const at::Tensor& norm_weight, const at::Tensor& qkv_weight,
    const std::optional<at::Tensor>& qkv_bias, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
    at::Tensor& v_cache, const at::Tensor& o_weight, const std::optional<at::Tensor>& o_bias,
    const at::Tensor& ffn_norm_weight, int64_t position, int64_t window, double eps, double scale,
    const std::optional<c10::string_view>& qkv_format, const std::optional<c10::string_view>& o_format) {
  const DecoderHeads heads =
      check_decoder_attention_args(x_in, norm_weight, qkv_weight, qkv_bias, q_norm, k_norm, cos, sin, k_cache, v_cache,
                                   o_weight, o_bias, ffn_norm_weight, position, qkv_format, o_format);
  TORCH_CHECK(x_in.device().is_cpu(), "decoder_attention: the CPU kernel got tensors on ", x_in.device());
  const int64_t d = x_in.size(1), D = heads.head_dim, n_qk = heads.n_q + heads.n_kv;
  const at::Tensor x = x_in.contiguous(), nw = norm_weight.contiguous(), c = cos.contiguous(), s = sin.contiguous();
  at::Tensor h = at::empty({1, d}, x.options());
  rms_norm(x.data_ptr<float>(), nw.data_ptr<float>(), d, eps, h.data_ptr<float>());
  at::Tensor qkv = project(h, qkv_weight, qkv_format, qkv_bias);  // [1, (Hq + 2 Hkv) D] float32
  float* heads_ptr = qkv.data_ptr<float>();
  if (q_norm) {
    const at::Tensor qn = q_norm->contiguous(), kn = k_norm->contiguous();
    for (int64_t i = 0; i < n_qk; ++i) {
      float* head = heads_ptr + i * D;
      rms_norm(head, (i < heads.n_q ? qn : kn).data_ptr<float>(), D, eps, head);
    }
  }
  for (int64_t i = 0; i < n_qk; ++i) rotate(heads_ptr + i * D, c.data_ptr<float>(), s.data_ptr<float>(), D);
  std::vector<float> q_scaled(heads.n_q * D), lse(heads.n_q);
  with_cache_type(k_cache.scalar_type(), [&](auto element) {
    store_token<decltype(element)>(heads_ptr, heads_ptr + heads.n_q * D, heads_ptr + n_qk * D, heads, k_cache, v_cache,
                                   position, static_cast<float>(scale), q_scaled.data());
  });
  const int64_t first = window > 0 ? std::max<int64_t>(0, position + 1 - window) : 0;
  const AttentionShape shape{1, heads.n_q, heads.n_kv, D, position + 1 - first};
  at::Tensor attn = at::empty({1, heads.n_q * D}, x.options());
  decode_attention_scaled(shape, q_scaled.data(), k_cache.slice(0, first, position + 1),
                          v_cache.slice(0, first, position + 1), attn.data_ptr<float>(), lse.data());
  at::Tensor out = project(attn, o_weight, o_format, o_bias);
  float* out_ptr = out.data_ptr<float>();
  const float* x_ptr = x.data_ptr<float>();
  for (int64_t i = 0; i < d; ++i) out_ptr[i] += x_ptr[i];
  at::Tensor ffn_in = at::empty({1, d}, x.options());
  const at::Tensor fw = ffn_norm_weight.contiguous();
  rms_norm(out.data_ptr<float>(), fw.data_ptr<float>(), d, eps, ffn_in.data_ptr<float>());
  return {out, ffn_in};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashllm, CPU, m) {
  m.impl("decoder_attention", &decoder_attention_cpu);
}

}  // namespace flashllm
