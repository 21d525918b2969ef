// Torch glue of the CUDA kernels: argument checks, launch on the current stream. Compiled only when torch has CUDA.
// Nothing here synchronises with the host unless kernel checks are on (common/kernel_checks.h): then the data is
// checked on the host and errors reported by the kernels become RuntimeErrors, as on the CPU.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>

#include "common/attention_host.h"
#include "common/endor_checks.h"
#include "common/endor_linear_host.h"
#include "common/endor_report.h"
#include "common/ffn_grid.h"
#include "common/ffn_host.h"
#include "common/kernel_checks.h"
#include "common/quantized_linear_host.h"
#include "cuda/kernels.cuh"

namespace flashllm {
namespace {

void endor_decompress_out_cuda(const at::Tensor& values, const at::Tensor& bitmap, const at::Tensor& row_offsets,
                               int64_t n_cols, const std::optional<at::Tensor>& rows, at::Tensor out) {
  const int64_t n_out = check_endor_args(values, bitmap, row_offsets, n_cols, rows, &out);
  TORCH_CHECK(values.is_cuda(), "endor_decompress: the CUDA kernel got values on ", values.device());
  const c10::cuda::CUDAGuard guard(values.device());
  const at::Tensor values_c = values.contiguous();
  const at::Tensor bitmap_c = bitmap.contiguous();
  const at::Tensor offsets_c = row_offsets.contiguous();
  std::optional<at::Tensor> rows_c;
  if (rows.has_value()) rows_c = rows->contiguous();
  static_assert(sizeof(EndorReport) % sizeof(int64_t) == 0);
  at::Tensor report = at::empty({int64_t(sizeof(EndorReport) / sizeof(int64_t))}, values.options().dtype(at::kLong));
  C10_CUDA_CHECK(launch_endor_decompress(
      values_c.data_ptr(), static_cast<int>(values_c.element_size()), bitmap_c.data_ptr<uint8_t>(),
      offsets_c.data_ptr<int64_t>(), rows_c.has_value() ? rows_c->data_ptr<int64_t>() : nullptr, bitmap_c.size(0),
      n_cols, values_c.numel(), n_out, out.data_ptr(), reinterpret_cast<EndorReport*>(report.data_ptr<int64_t>()),
      c10::cuda::getCurrentCUDAStream()));
  // Reading the report back synchronises, so only kernel checks do it; otherwise refused rows stay zeros in `out`.
  if (!kernel_checks_enabled()) return;
  const at::Tensor report_host = report.cpu();
  check_endor_report("endor_decompress", *reinterpret_cast<const EndorReport*>(report_host.data_ptr<int64_t>()),
                     values_c, bitmap_c, offsets_c, n_cols, rows_c);
}

at::Tensor endor_linear_cuda(const at::Tensor& x, const at::Tensor& values, const at::Tensor& bitmap,
                             const at::Tensor& row_offsets, int64_t n_cols, const std::optional<at::Tensor>& bias) {
  const c10::cuda::CUDAGuard guard(values.device());
  return endor_linear_gpu_style(
      x, values, bitmap, row_offsets, n_cols, bias, kernel_checks_enabled(), [&](const EndorLinearCall& call) {
        C10_CUDA_CHECK(launch_endor_linear(call.x.data_ptr<float>(), call.x.size(0), call.values.data_ptr(),
                                           call.kind(), call.bitmap.data_ptr<uint8_t>(),
                                           call.offsets.data_ptr<int64_t>(), call.bitmap.size(0), n_cols,
                                           call.values.numel(), call.bias_ptr(), call.y.data_ptr<float>(), call.report,
                                           c10::cuda::getCurrentCUDAStream()));
      });
}

at::Tensor sparse_ffn_cuda(const at::Tensor& x, const at::Tensor& matrix, int64_t num_used,
                           const std::optional<at::Tensor>& bias, c10::string_view activation, bool glu,
                           const std::optional<at::Tensor>& index, double threshold) {
  const c10::cuda::CUDAGuard guard(x.device());
  const std::optional<at::Tensor> bias_c = bias.has_value() ? std::optional<at::Tensor>(bias->contiguous()) : bias;
  return sparse_ffn_gpu_style(
      x, matrix, num_used, bias_c, activation, glu, index, threshold, kernel_checks_enabled(),
      [&](const at::Tensor& xf, int64_t n_rows, const int64_t* ids, int act, at::Tensor& y) {
        const int64_t n_tok = xf.size(0), d = xf.size(1), group = std::min<int64_t>(n_tok, kFfnMaxTokens);
        const int64_t chunks = ffn_grid(n_rows, d, static_cast<int>(matrix.element_size())).chunks;
        at::Tensor act_buf = at::empty({group * n_rows}, xf.options());
        at::Tensor partial = at::empty({chunks * group * d}, xf.options());
        C10_CUDA_CHECK(launch_sparse_ffn(xf.data_ptr<float>(), n_tok, d, matrix.data_ptr(),
                                         ffn_kind(matrix.scalar_type()), bias_c ? bias_c->data_ptr() : nullptr, ids,
                                         n_rows, num_used, act, glu, static_cast<float>(threshold),
                                         act_buf.data_ptr<float>(), partial.data_ptr<float>(), y.data_ptr<float>(),
                                         c10::cuda::getCurrentCUDAStream()));
      });
}

at::Tensor quantized_sparse_ffn_cuda(const at::Tensor& x, const at::Tensor& matrix, int64_t num_used,
                                     const std::optional<at::Tensor>& bias, c10::string_view activation, bool glu,
                                     c10::string_view bundle_format, const std::optional<at::Tensor>& index,
                                     double threshold) {
  const c10::cuda::CUDAGuard guard(x.device());
  return quantized_sparse_ffn_gpu_style(
      x, matrix, num_used, bias, activation, glu, std::string(bundle_format), index, threshold, kernel_checks_enabled(),
      [&](const QuantizedFfnCall& call, const at::Tensor& xf, int64_t n_rows, const int64_t* ids, int act,
          at::Tensor& y) {
        C10_CUDA_CHECK(launch_quantized_sparse_ffn(
            xf.data_ptr<float>(), xf.size(0), xf.size(1), call.matrix.data_ptr<uint8_t>(), call.layout.row_bytes,
            call.layout.in_format, call.layout.down_format, call.bias_ptr(), ids, n_rows, num_used, act, glu,
            static_cast<float>(threshold), call.codes.data_ptr<int8_t>(), call.scale.data_ptr<float>(),
            call.scaled_sum.data_ptr<float>(), call.act_buf.data_ptr<float>(), call.partial.data_ptr<float>(),
            y.data_ptr<float>(), c10::cuda::getCurrentCUDAStream()));
      });
}

at::Tensor quantized_linear_cuda(const at::Tensor& x, const at::Tensor& weight, c10::string_view weight_format,
                                 const std::optional<at::Tensor>& bias) {
  const c10::cuda::CUDAGuard guard(x.device());
  return quantized_linear_gpu_style(x, weight, std::string(weight_format), bias, [&](const QuantizedLinearCall& call) {
    C10_CUDA_CHECK(launch_quantized_linear(
        call.x.data_ptr<float>(), call.x.size(0), call.x.size(1), call.weight.data_ptr<uint8_t>(), call.format,
        call.weight.size(0), call.bias_ptr(), call.codes.data_ptr<int8_t>(), call.scale.data_ptr<float>(),
        call.scaled_sum.data_ptr<float>(), call.y.data_ptr<float>(), c10::cuda::getCurrentCUDAStream()));
  });
}

int64_t cache_compact_cuda(at::Tensor& matrix, at::Tensor& pointer, const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& slot_of, int64_t num_used, const at::Tensor& rows) {
  const c10::cuda::CUDAGuard guard(matrix.device());
  return cache_compact_gpu_style(
      matrix, pointer, bias, slot_of, num_used, rows, kernel_checks_enabled(), [&](const int64_t* sorted, int64_t c) {
        C10_CUDA_CHECK(launch_cache_compact(
            static_cast<uint8_t*>(matrix.data_ptr()), matrix.size(1) * matrix.element_size(),
            pointer.data_ptr<int64_t>(), bias ? static_cast<uint8_t*>(bias->data_ptr()) : nullptr,
            bias ? static_cast<int>(bias->element_size()) : 0, slot_of ? slot_of->data_ptr<int64_t>() : nullptr,
            slot_of ? slot_of->numel() : 0, sorted, c, num_used, c10::cuda::getCurrentCUDAStream()));
      });
}

std::tuple<at::Tensor, at::Tensor> decode_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                         std::optional<double> scale) {
  const c10::cuda::CUDAGuard guard(q.device());
  return decode_attention_gpu_style(
      q, k, v, scale,
      [&](const at::Tensor& qf, const at::Tensor& kc, const at::Tensor& vc, int kind, const AttentionArgs& args,
          at::Tensor& out, at::Tensor& lse) {
        C10_CUDA_CHECK(launch_decode_attention(qf.data_ptr<float>(), kc.data_ptr(), vc.data_ptr(), kind, args,
                                               out.data_ptr<float>(), lse.data_ptr<float>(),
                                               c10::cuda::getCurrentCUDAStream()));
      });
}

std::tuple<at::Tensor, at::Tensor> merge_attention_states_cuda(const at::Tensor& outs, const at::Tensor& lses) {
  const c10::cuda::CUDAGuard guard(outs.device());
  return merge_attention_states_gpu_style(
      outs, lses,
      [&](const at::Tensor& oc, const at::Tensor& lc, int64_t n_parts, int64_t n_rows, int64_t head_dim,
          at::Tensor& out, at::Tensor& lse) {
        C10_CUDA_CHECK(launch_merge_attention_states(oc.data_ptr<float>(), lc.data_ptr<float>(), n_parts, n_rows,
                                                     head_dim, out.data_ptr<float>(), lse.data_ptr<float>(),
                                                     c10::cuda::getCurrentCUDAStream()));
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(flashllm, CUDA, m) {
  m.impl("endor_decompress", &endor_decompress_allocating<&endor_decompress_out_cuda>);
  m.impl("endor_decompress.out", &endor_decompress_out_cuda);
  m.impl("endor_linear", &endor_linear_cuda);
  m.impl("sparse_ffn", &sparse_ffn_cuda);
  m.impl("quantized_sparse_ffn", &quantized_sparse_ffn_cuda);
  m.impl("quantized_linear", &quantized_linear_cuda);
  m.impl("cache_compact", &cache_compact_cuda);
  m.impl("decode_attention", &decode_attention_cuda);
  m.impl("merge_attention_states", &merge_attention_states_cuda);
}

}  // namespace flashllm
