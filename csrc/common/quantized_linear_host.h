// Host side of the GPU-style quantized_linear kernels (the CUDA glue and the SIMT test op run the same code with a
// different launcher): argument checks, float32 copies of x and bias (T x d: small), the scratch x is quantized into
// (csrc/cuda/quantized_linear_kernel.cuh), and the cast of y to x's dtype.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "common/quantized_linear_checks.h"

namespace flashllm {

// The contiguous tensors a GPU-style quantized_linear launch reads and writes.
struct QuantizedLinearCall {
  at::Tensor x, weight, codes, scale, scaled_sum, y;  // x, scale, scaled_sum, y float32; codes int8
  std::optional<at::Tensor> bias;                     // float32
  int format;
  const float* bias_ptr() const { return bias.has_value() ? bias->data_ptr<float>() : nullptr; }
};

// launch(const QuantizedLinearCall&) runs the kernels; returns y of x's dtype.
template <class Launch>
at::Tensor quantized_linear_gpu_style(const at::Tensor& x, const at::Tensor& weight, const std::string& weight_format,
                                      const std::optional<at::Tensor>& bias, Launch&& launch) {
  const int format = check_quantized_linear_args(x, weight, weight_format, bias);
  const int64_t n_tok = x.size(0), n_blocks = (x.size(1) + kBlock - 1) / kBlock;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  QuantizedLinearCall call{xf,
                           weight,
                           at::empty({n_tok, n_blocks * kBlock}, xf.options().dtype(at::kChar)),
                           at::empty({n_tok, n_blocks}, xf.options()),
                           at::empty({n_tok, n_blocks}, xf.options()),
                           at::empty({n_tok, weight.size(0)}, xf.options()),
                           std::nullopt,
                           format};
  if (bias.has_value()) call.bias = bias->to(at::kFloat).contiguous();
  launch(call);
  return call.y.to(x.scalar_type());
}

}  // namespace flashllm
