// Argument checks of flashllm::decode_attention shared by every native kernel (CPU, CUDA, SIMT test ops);
// flashllm_ext/ops/attention.py makes the same checks for the reference kernel, with the same words. Metadata only: the
// kernels read every value they are given, so there is no data to check.
#pragma once
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <optional>

namespace flashllm {

// The shape of one decode_attention call: q [batch, n_q_heads, head_dim], k and v [seq, batch, n_kv_heads, head_dim].
struct AttentionShape {
  int64_t batch, n_q_heads, n_kv_heads, head_dim, seq;
  int64_t group() const { return n_q_heads / n_kv_heads; }  // query heads per kv head
};

// Checks the arguments and returns the call's shape; `scale` becomes the scale to use (1/sqrt(D) when absent).
inline AttentionShape check_decode_attention_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const std::optional<double>& scale_in, double* scale) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16) && q.dim() == 3,
              "decode_attention: q must be a 3-D float32/float16/bfloat16 tensor [B, Hq, D], got ", dtype, " of shape ",
              q.sizes());
  const char* names[2] = {"k", "v"};
  const at::Tensor* kv[2] = {&k, &v};
  for (int i = 0; i < 2; ++i) {
    TORCH_CHECK(kv[i]->scalar_type() == dtype && kv[i]->dim() == 4, "decode_attention: ", names[i],
                " must be a 4-D tensor [S, B, Hkv, D] of q's dtype, got ", kv[i]->scalar_type(), " of shape ",
                kv[i]->sizes());
    TORCH_CHECK(kv[i]->device() == q.device(), "decode_attention: ", names[i], " is on ", kv[i]->device(),
                " but q is on ", q.device());
  }
  TORCH_CHECK(k.sizes() == v.sizes(), "decode_attention: k and v must have the same shape, got ", k.sizes(), " and ",
              v.sizes());
  const AttentionShape s{q.size(0), q.size(1), k.size(2), q.size(2), k.size(0)};
  TORCH_CHECK(k.size(1) == s.batch && k.size(3) == s.head_dim, "decode_attention: k and v must be [S, B=", s.batch,
              ", Hkv, D=", s.head_dim, "] to match q ", q.sizes(), ", got ", k.sizes());
  TORCH_CHECK(s.head_dim >= 1, "decode_attention: head_dim D must be >= 1");
  TORCH_CHECK(s.n_kv_heads >= 1 && s.n_q_heads >= 1 && s.n_q_heads % s.n_kv_heads == 0,
              "decode_attention: the query heads Hq=", s.n_q_heads,
              " must be a positive multiple of the kv heads Hkv=", s.n_kv_heads);
  if (scale_in.has_value()) {
    TORCH_CHECK(std::isfinite(*scale_in), "decode_attention: scale must be finite, got ", *scale_in);
    *scale = *scale_in;
  } else {
    *scale = 1.0 / std::sqrt(double(s.head_dim));
  }
  return s;
}

// k or v with a unit stride on head_dim (a strided view of it otherwise becomes a contiguous copy): the kernels
// read rows of D elements and step between them with the other three strides.
inline at::Tensor with_unit_inner_stride(const at::Tensor& t) {
  return t.size(3) <= 1 || t.stride(3) == 1 ? t : t.contiguous();
}

}  // namespace flashllm
