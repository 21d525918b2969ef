// Argument checks of flashllm::half_linear (CPU only: on a GPU the library's half-precision linears are cuBLAS's);
// flashllm_ext/ops/linear.py makes the same checks for the reference and fake kernels, with the same words.
#pragma once
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>

namespace flashllm {

inline bool is_linear_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

inline void check_half_linear_args(const at::Tensor& x, const at::Tensor& weight,
                                   const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(is_linear_dtype(x.scalar_type()) && x.dim() == 2,
              "half_linear: x must be a 2-D float32/float16/bfloat16 tensor [T, d], got ", x.scalar_type(),
              " of shape ", x.sizes());
  TORCH_CHECK(is_linear_dtype(weight.scalar_type()) && weight.dim() == 2 && weight.size(1) == x.size(1),
              "half_linear: weight must be a 2-D float32/float16/bfloat16 tensor [n, d=", x.size(1), "], got ",
              weight.scalar_type(), " of shape ", weight.sizes());
  TORCH_CHECK(
      !bias || (bias->scalar_type() == weight.scalar_type() && bias->dim() == 1 && bias->size(0) == weight.size(0)),
      "half_linear: bias must be ", weight.scalar_type(), " (the weight's dtype) of shape [n=", weight.size(0),
      "], got ", bias ? bias->scalar_type() : weight.scalar_type(), " of shape ",
      bias ? bias->sizes() : at::IntArrayRef{});
  TORCH_CHECK(weight.device() == x.device() && (!bias || bias->device() == x.device()),
              "half_linear: weight and bias must be on x's device (", x.device(), "), got ", weight.device(),
              bias ? " and " : "", bias ? c10::str(bias->device()) : "");
}

}  // namespace flashllm
