// torch.ops.flashllm_simt.quantized_linear_cuda: the CUDA build's quantized_linear launcher run on CPU tensors through
// the SIMT emulation, behind the host code of the real glue (common/quantized_linear_host.h: the checks, float32
// copies, scratch and result cast of csrc/cuda/ops_cuda.cpp).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <stdexcept>
#include <string>

#include "common/quantized_linear_host.h"
#include "simt/bodies.h"

namespace flashllm {
namespace {

at::Tensor quantized_linear_simt_cuda(const at::Tensor& x, const at::Tensor& weight, c10::string_view weight_format,
                                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu(), "quantized_linear: the SIMT emulation runs on CPU tensors, got ", x.device());
  return quantized_linear_gpu_style(x, weight, std::string(weight_format), bias, [&](const QuantizedLinearCall& call) {
    try {
      simt_bodies::run_quantized_linear_cuda(
          call.x.data_ptr<float>(), call.x.size(0), call.x.size(1), call.weight.data_ptr<uint8_t>(), call.format,
          call.weight.size(0), call.bias_ptr(), call.codes.data_ptr<int8_t>(), call.scale.data_ptr<float>(),
          call.scaled_sum.data_ptr<float>(), call.y.data_ptr<float>());
    } catch (const std::runtime_error& e) {
      // A failed emulated launch (simt::LaunchError) is a kernel bug: say so rather than blame the input.
      TORCH_CHECK(false, "quantized_linear: SIMT emulation failed: ", e.what());
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashllm_simt, m) {
  m.def("quantized_linear_cuda(Tensor x, Tensor weight, str weight_format, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(flashllm_simt, CPU, m) {
  m.impl("quantized_linear_cuda", &quantized_linear_simt_cuda);
}

}  // namespace flashllm
