// Argument checks of flashllm::quantized_linear (CPU and CUDA kernels); flashllm_ext/ops/linear.py makes the same
// checks for the reference and fake kernels, with the same words.
#pragma once
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "common/quantized_ffn_checks.h"

namespace flashllm {

// Returns the weight's block format code.
inline int check_quantized_linear_args(const at::Tensor& x, const at::Tensor& weight, const std::string& weight_format,
                                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(is_ffn_dtype(x.scalar_type()) && x.dim() == 2,
              "quantized_linear: x must be a 2-D float32/float16/bfloat16 tensor [T, d], got ", x.scalar_type(),
              " of shape ", x.sizes());
  const int format = parse_block_format(weight_format);
  TORCH_CHECK(format >= 0, "quantized_linear: weight_format must be one of ('q8_0', 'q4_0', 'q4_1'), got '",
              weight_format, "'");
  const int64_t width = (x.size(1) + kBlock - 1) / kBlock * block_bytes(format);
  TORCH_CHECK(
      weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.size(1) == width && weight.is_contiguous(),
      "quantized_linear: weight must be contiguous uint8 of shape [n, ", width, "] (", weight_format,
      " rows of d=", x.size(1), "), got ", weight.scalar_type(), " of shape ", weight.sizes());
  TORCH_CHECK(!bias || (bias->scalar_type() == x.scalar_type() && bias->dim() == 1 && bias->size(0) == weight.size(0)),
              "quantized_linear: bias must be ", x.scalar_type(), " (x's dtype) of shape [n=", weight.size(0),
              "], got ", bias ? bias->scalar_type() : x.scalar_type(), " of shape ",
              bias ? bias->sizes() : at::IntArrayRef{});
  TORCH_CHECK(weight.device() == x.device() && (!bias || bias->device() == x.device()),
              "quantized_linear: weight and bias must be on x's device (", x.device(), "), got ", weight.device(),
              bias ? " and " : "", bias ? c10::str(bias->device()) : "");
  return format;
}

}  // namespace flashllm
