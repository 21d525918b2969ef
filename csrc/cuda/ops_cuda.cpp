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
  // The kernel's report comes back in one copy, which synchronises: a RuntimeError about the data needs that anyway.
  static_assert(sizeof(EndorReport) % sizeof(int64_t) == 0);
  at::Tensor report = at::empty({int64_t(sizeof(EndorReport) / sizeof(int64_t))}, values.options().dtype(at::kLong));
  C10_CUDA_CHECK(launch_endor_decompress(
      values_c.data_ptr(), static_cast<int>(values_c.element_size()), bitmap_c.data_ptr<uint8_t>(),
      offsets_c.data_ptr<int64_t>(), rows_c.has_value() ? rows_c->data_ptr<int64_t>() : nullptr, bitmap_c.size(0),
      n_cols, values_c.numel(), n_out, out.data_ptr(), reinterpret_cast<EndorReport*>(report.data_ptr<int64_t>()),
      c10::cuda::getCurrentCUDAStream()));
  const at::Tensor report_host = report.cpu();
  check_endor_report(*reinterpret_cast<const EndorReport*>(report_host.data_ptr<int64_t>()), values_c, bitmap_c,
                     offsets_c, n_cols, rows_c);
}

}  // namespace

TORCH_LIBRARY_IMPL(flashllm, CUDA, m) {
  m.impl("endor_decompress", &endor_decompress_allocating<&endor_decompress_out_cuda>);
  m.impl("endor_decompress.out", &endor_decompress_out_cuda);
}

}  // namespace flashllm
