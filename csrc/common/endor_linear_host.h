// Host side of the GPU-style endor_linear kernels (the CUDA glue and the SIMT test ops run the same code with a
// different launcher): argument checks, float32 copies of x and bias (T x n_cols: small), the report, the data checks
// when asked for (check_data: reading the report back synchronises; common/kernel_checks.h), and the cast of y to x's
// dtype.
#pragma once
#include <ATen/ATen.h>

#include <optional>

#include "common/endor_checks.h"
#include "common/endor_codes.h"
#include "common/endor_report.h"
#include "common/ffn_host.h"

namespace flashllm {

// The contiguous tensors a GPU-style endor_linear kernel reads and writes.
struct EndorLinearCall {
  at::Tensor x, values, bitmap, offsets, y;  // x and y float32
  std::optional<at::Tensor> bias;            // float32
  EndorReport* report;
  int kind() const { return ffn_kind(values.scalar_type()); }
  const float* bias_ptr() const { return bias.has_value() ? bias->data_ptr<float>() : nullptr; }
};

// launch(const EndorLinearCall&) runs the kernels; returns y of x's dtype. Without check_data a refused row comes out
// as zeros.
template <class Launch>
at::Tensor endor_linear_gpu_style(const at::Tensor& x, const at::Tensor& values, const at::Tensor& bitmap,
                                  const at::Tensor& row_offsets, int64_t n_cols, const std::optional<at::Tensor>& bias,
                                  bool check_data, Launch&& launch) {
  const int64_t n_rows = check_endor_linear_args(x, values, bitmap, row_offsets, n_cols, bias);
  static_assert(sizeof(EndorReport) % sizeof(int64_t) == 0);
  at::Tensor report = at::empty({int64_t(sizeof(EndorReport) / sizeof(int64_t))}, values.options().dtype(at::kLong));
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  EndorLinearCall call{xf,
                       values.contiguous(),
                       bitmap.contiguous(),
                       row_offsets.contiguous(),
                       at::empty({x.size(0), n_rows}, xf.options()),
                       std::nullopt,
                       reinterpret_cast<EndorReport*>(report.data_ptr<int64_t>())};
  if (bias.has_value()) call.bias = bias->to(at::kFloat).contiguous();
  launch(call);
  if (check_data) {
    const at::Tensor report_host = report.cpu();
    check_endor_report("endor_linear", *reinterpret_cast<const EndorReport*>(report_host.data_ptr<int64_t>()),
                       call.values, call.bitmap, call.offsets, n_cols, std::nullopt);
  }
  return call.y.to(x.scalar_type());
}

}  // namespace flashllm
