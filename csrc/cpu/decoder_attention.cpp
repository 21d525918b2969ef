// flashllm::decoder_attention on the CPU: the attention half of a Llama-family decoder layer for one decode token in
// one call, so a token pays one dispatch per layer for it instead of a dozen small tensor ops (each a few
// microseconds of framework time against ~60 us of weight reads at 135M shapes).
//
// The two matrix products and the attention are the library's own ops (flashllm::half_linear on float weights, at the
// read bound, or flashllm::quantized_linear on rows of blocks; flashllm::decode_attention on the cache in place),
// called through the dispatcher; the norms, the per-head q/k norms, RoPE and the cache writes are plain loops over a
// few hundred floats between them.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

#include "common/decoder_attention_checks.h"

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

std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    double scale) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("flashllm::decode_attention", "")
                             .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                       const at::Tensor&, std::optional<double>)>();
  return op.call(q, k, v, scale);
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
  const at::Tensor k_new = qkv.narrow(1, heads.n_q * D, heads.n_kv * D).view({heads.n_kv, D});
  const at::Tensor v_new = qkv.narrow(1, n_qk * D, heads.n_kv * D).view({heads.n_kv, D});
  k_cache.select(0, position).select(0, 0).copy_(k_new);
  v_cache.select(0, position).select(0, 0).copy_(v_new);
  const int64_t first = window > 0 ? std::max<int64_t>(0, position + 1 - window) : 0;
  const at::Tensor q = qkv.narrow(1, 0, heads.n_q * D).view({1, heads.n_q, D}).to(k_cache.scalar_type());
  const auto [attn, lse] =
      decode_attention(q, k_cache.slice(0, first, position + 1), v_cache.slice(0, first, position + 1), scale);
  at::Tensor out = project(attn.view({1, heads.n_q * D}), o_weight, o_format, o_bias);
  out.add_(x);
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
