// torch.ops.flashllm_simt.endor_decompress_{cuda,metal}: the CUDA build's Endor launcher and the Metal Endor kernel
// body run on CPU tensors through the SIMT emulation, with the argument checks and error reporting of the real glue.
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <stdexcept>

#include "common/endor_checks.h"
#include "common/endor_report.h"
#include "simt/bodies.h"

namespace flashllm {
namespace {

// The tensors as the kernels read them (contiguous), and the output.
struct EndorCall {
  at::Tensor values, bitmap, offsets, out;
  std::optional<at::Tensor> rows;
  const int64_t* rows_ptr() const { return rows.has_value() ? rows->data_ptr<int64_t>() : nullptr; }
  int elem_bytes() const { return static_cast<int>(values.element_size()); }
};

EndorCall prepare_endor_call(const at::Tensor& values, const at::Tensor& bitmap, const at::Tensor& row_offsets,
                             int64_t n_cols, const std::optional<at::Tensor>& rows) {
  const int64_t n_out = check_endor_args(values, bitmap, row_offsets, n_cols, rows, nullptr);
  TORCH_CHECK(values.device().is_cpu(), "endor_decompress: the SIMT emulation runs on CPU tensors, got ",
              values.device());
  EndorCall call{values.contiguous(), bitmap.contiguous(), row_offsets.contiguous(),
                 at::empty({n_out, n_cols}, values.options()), std::nullopt};
  if (rows.has_value()) call.rows = rows->contiguous();
  // All-ones bytes (NaN for floats): an element a kernel leaves unwritten shows in the tests. (An empty output may
  // have no data pointer, which memset must not get.)
  if (call.out.numel() > 0) std::memset(call.out.data_ptr(), 0xff, call.out.nbytes());
  return call;
}

// check_data=false leaves the report unread, as the CUDA glue does without kernel checks (refused rows are zeros).
at::Tensor endor_decompress_simt_cuda(const at::Tensor& values, const at::Tensor& bitmap, const at::Tensor& row_offsets,
                                      int64_t n_cols, const std::optional<at::Tensor>& rows, bool check_data) {
  const EndorCall call = prepare_endor_call(values, bitmap, row_offsets, n_cols, rows);
  EndorReport report;
  try {
    report = simt_bodies::run_endor_cuda(call.values.data_ptr(), call.elem_bytes(), call.bitmap.data_ptr<uint8_t>(),
                                         call.offsets.data_ptr<int64_t>(), call.rows_ptr(), call.bitmap.size(0), n_cols,
                                         call.values.numel(), call.out.size(0), call.out.data_ptr());
  } catch (const std::runtime_error& e) {
    // A failed emulated launch (simt::LaunchError) is a kernel bug: say so rather than blame the input.
    TORCH_CHECK(false, "endor_decompress: SIMT emulation failed: ", e.what());
  }
  if (check_data)
    check_endor_report("endor_decompress", report, call.values, call.bitmap, call.offsets, n_cols, call.rows);
  return call.out;
}

at::Tensor endor_decompress_simt_metal(const at::Tensor& values, const at::Tensor& bitmap,
                                       const at::Tensor& row_offsets, int64_t n_cols,
                                       const std::optional<at::Tensor>& rows) {
  const EndorCall call = prepare_endor_call(values, bitmap, row_offsets, n_cols, rows);
  // What flashllm_ext.mlx checks on the host before dispatching the Metal kernel.
  const int64_t* offsets = call.offsets.data_ptr<int64_t>();
  check_endor_offset_ends("endor_decompress", offsets[0], offsets[call.bitmap.size(0)], call.values.numel());
  const int64_t n_out = call.out.size(0);
  if (n_out == 0) return call.out;
  at::Tensor status = at::empty({n_out}, values.options().dtype(at::kInt));
  try {
    simt_bodies::run_endor_metal(call.values.data_ptr(), call.elem_bytes(), call.bitmap.data_ptr<uint8_t>(), offsets,
                                 call.rows_ptr(), call.bitmap.size(0), n_cols, call.values.numel(), n_out,
                                 call.out.data_ptr(), status.data_ptr<int32_t>());
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, "endor_decompress: SIMT emulation failed: ", e.what());
  }
  const at::Tensor bad = status.nonzero();
  if (bad.numel() > 0) {
    const int64_t o = bad[0][0].item<int64_t>();
    throw_endor_row_error("endor_decompress", o, status[o].item<int32_t>(), call.values, call.bitmap, call.offsets,
                          n_cols, call.rows);
  }
  return call.out;
}

}  // namespace

TORCH_LIBRARY(flashllm_simt, m) {
  m.def(
      "endor_decompress_cuda(Tensor values, Tensor bitmap, Tensor row_offsets, int n_cols, Tensor? rows=None, "
      "bool check_data=True) -> Tensor");
  m.def(
      "endor_decompress_metal(Tensor values, Tensor bitmap, Tensor row_offsets, int n_cols, Tensor? rows=None) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(flashllm_simt, CPU, m) {
  m.impl("endor_decompress_cuda", &endor_decompress_simt_cuda);
  m.impl("endor_decompress_metal", &endor_decompress_simt_metal);
}

}  // namespace flashllm
