// Torch glue of the CUDA kernels: argument checks, launch on the current stream, errors reported by the kernel
// turned into RuntimeError. Compiled only when torch has CUDA.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>

#include "common/endor_checks.h"
#include "common/endor_report.h"
#include "cuda/kernels.cuh"

namespace flashllm {
namespace {

at::Tensor& endor_decompress_out_cuda(const at::Tensor& values, const at::Tensor& bitmap,
                                      const at::Tensor& row_offsets, int64_t n_cols,
                                      const std::optional<at::Tensor>& rows, at::Tensor& out) {
  const int64_t n_out = check_endor_args(values, bitmap, row_offsets, n_cols, rows, &out);
  TORCH_CHECK(values.is_cuda(), "endor_decompress: the CUDA kernel got values on ", values.device());
  const c10::cuda::CUDAGuard guard(values.device());
  const at::Tensor values_c = values.contiguous();
  const at::Tensor bitmap_c = bitmap.contiguous();
  const at::Tensor offsets_c = row_offsets.contiguous();
  std::optional<at::Tensor> rows_c;
  if (rows.has_value()) rows_c = rows->contiguous();
  // One device word for the kernel's verdict; reading it back synchronises, which a RuntimeError needs anyway.
  at::Tensor error = at::empty({1}, values.options().dtype(at::kLong));
  C10_CUDA_CHECK(launch_endor_decompress(
      values_c.data_ptr(), static_cast<int>(values_c.element_size()), bitmap_c.data_ptr<uint8_t>(),
      offsets_c.data_ptr<int64_t>(), rows_c.has_value() ? rows_c->data_ptr<int64_t>() : nullptr, bitmap_c.size(0),
      n_cols, values_c.numel(), n_out, out.data_ptr(), reinterpret_cast<unsigned long long*>(error.data_ptr<int64_t>()),
      c10::cuda::getCurrentCUDAStream()));
  check_endor_error_word(static_cast<unsigned long long>(error.item<int64_t>()), values_c, bitmap_c, offsets_c,
                         rows_c);
  return out;
}

at::Tensor endor_decompress_cuda(const at::Tensor& values, const at::Tensor& bitmap, const at::Tensor& row_offsets,
                                 int64_t n_cols, const std::optional<at::Tensor>& rows) {
  const int64_t n_out = check_endor_args(values, bitmap, row_offsets, n_cols, rows, nullptr);
  at::Tensor out = at::empty({n_out, n_cols}, values.options());
  return endor_decompress_out_cuda(values, bitmap, row_offsets, n_cols, rows, out);
}

}  // namespace

TORCH_LIBRARY_IMPL(flashllm, CUDA, m) {
  m.impl("endor_decompress", &endor_decompress_cuda);
  m.impl("endor_decompress.out", &endor_decompress_out_cuda);
}

}  // namespace flashllm
