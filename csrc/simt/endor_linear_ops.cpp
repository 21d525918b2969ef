// torch.ops.flashllm_simt.endor_linear_{cuda,metal}: the CUDA build's endor_linear launcher and the Metal kernel body
// run on CPU tensors through the SIMT emulation, behind the host code of the real glue (common/endor_linear_host.h:
// the checks, float32 copies and result cast of csrc/cuda/ops_cuda.cpp) or, for Metal, what flashllm_ext.mlx does.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <stdexcept>

#include "common/endor_linear_host.h"
#include "simt/bodies.h"

namespace flashllm {
namespace {

constexpr int kMetalMaxTokens = 8;  // tokens per dispatch of metal/endor_linear.metal

void require_cpu(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "endor_linear: the SIMT emulation runs on CPU tensors, got ", t.device());
}

// check_data=false leaves the report unread, as the CUDA glue does without kernel checks (refused rows are zeros).
at::Tensor endor_linear_simt_cuda(const at::Tensor& x, const at::Tensor& values, const at::Tensor& bitmap,
                                  const at::Tensor& row_offsets, int64_t n_cols, const std::optional<at::Tensor>& bias,
                                  bool check_data) {
  require_cpu(values);
  return endor_linear_gpu_style(
      x, values, bitmap, row_offsets, n_cols, bias, check_data, [&](const EndorLinearCall& call) {
        try {
          simt_bodies::run_endor_linear_cuda(
              call.x.data_ptr<float>(), call.x.size(0), call.values.data_ptr(), call.kind(),
              call.bitmap.data_ptr<uint8_t>(), call.offsets.data_ptr<int64_t>(), call.bitmap.size(0), n_cols,
              call.values.numel(), call.bias_ptr(), call.y.data_ptr<float>(), call.report);
        } catch (const std::runtime_error& e) {
          // A failed emulated launch (simt::LaunchError) is a kernel bug: say so rather than blame the input.
          TORCH_CHECK(false, "endor_linear: SIMT emulation failed: ", e.what());
        }
      });
}

// What flashllm_ext.mlx does around metal/endor_linear.metal: the offsets' ends checked on the host, one dispatch
// per group of 8 tokens, then the first refused row raised.
at::Tensor endor_linear_simt_metal(const at::Tensor& x, const at::Tensor& values, const at::Tensor& bitmap,
                                   const at::Tensor& row_offsets, int64_t n_cols,
                                   const std::optional<at::Tensor>& bias) {
  require_cpu(values);
  const int64_t n_rows = check_endor_linear_args(x, values, bitmap, row_offsets, n_cols, bias);
  const at::Tensor values_c = values.contiguous(), bitmap_c = bitmap.contiguous(), offsets = row_offsets.contiguous();
  const int64_t* off = offsets.data_ptr<int64_t>();
  check_endor_offset_ends("endor_linear", off[0], off[n_rows], values_c.numel());
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const std::optional<at::Tensor> bias_f =
      bias.has_value() ? std::optional<at::Tensor>(bias->to(at::kFloat).contiguous()) : std::nullopt;
  const int64_t n_tok = x.size(0);
  at::Tensor y = at::zeros({n_tok, n_rows}, xf.options());
  if (n_rows == 0 || n_tok == 0) return y.to(x.scalar_type());
  at::Tensor status = at::zeros({n_rows}, values.options().dtype(at::kInt));
  for (int64_t t0 = 0; t0 < n_tok; t0 += kMetalMaxTokens) {
    const int64_t nt = std::min<int64_t>(kMetalMaxTokens, n_tok - t0);
    try {
      simt_bodies::run_endor_linear_metal(xf.data_ptr<float>() + t0 * n_cols, nt, values_c.data_ptr(),
                                          ffn_kind(values.scalar_type()), bitmap_c.data_ptr<uint8_t>(), off, n_rows,
                                          n_cols, values_c.numel(), bias_f ? bias_f->data_ptr<float>() : nullptr,
                                          y.data_ptr<float>() + t0 * n_rows, status.data_ptr<int32_t>());
    } catch (const std::runtime_error& e) {
      TORCH_CHECK(false, "endor_linear: SIMT emulation failed: ", e.what());
    }
    const at::Tensor bad = status.nonzero();
    if (bad.numel() > 0) {
      const int64_t r = bad[0][0].item<int64_t>();
      throw_endor_row_error("endor_linear", r, status[r].item<int32_t>(), values_c, bitmap_c, offsets, n_cols,
                            std::nullopt);
    }
  }
  return y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashllm_simt, m) {
  m.def(
      "endor_linear_cuda(Tensor x, Tensor values, Tensor bitmap, Tensor row_offsets, int n_cols, "
      "Tensor? bias=None, bool check_data=True) -> Tensor");
  m.def(
      "endor_linear_metal(Tensor x, Tensor values, Tensor bitmap, Tensor row_offsets, int n_cols, "
      "Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(flashllm_simt, CPU, m) {
  m.impl("endor_linear_cuda", &endor_linear_simt_cuda);
  m.impl("endor_linear_metal", &endor_linear_simt_metal);
}

}  // namespace flashllm
