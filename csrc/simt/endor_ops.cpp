// torch.ops.flashllm_simt.endor_decompress_{cuda,metal}: the CUDA and Metal Endor kernel bodies run on CPU tensors
// through the SIMT emulation, with the argument checks and error reporting of the real glue.
#include <torch/library.h>

#include <optional>
#include <stdexcept>

#include "common/endor_checks.h"
#include "common/endor_report.h"
#include "simt/bodies.h"

namespace flashllm {
namespace {

enum class Body { cuda, metal };

template <Body body>
at::Tensor endor_decompress_simt(const at::Tensor& values, const at::Tensor& bitmap, const at::Tensor& row_offsets,
                                 int64_t n_cols, const std::optional<at::Tensor>& rows) {
  const int64_t n_out = check_endor_args(values, bitmap, row_offsets, n_cols, rows, nullptr);
  TORCH_CHECK(values.device().is_cpu(), "endor_decompress: the SIMT emulation runs on CPU tensors, got ",
              values.device());
  const at::Tensor values_c = values.contiguous();
  const at::Tensor bitmap_c = bitmap.contiguous();
  const at::Tensor offsets_c = row_offsets.contiguous();
  std::optional<at::Tensor> rows_c;
  if (rows.has_value()) rows_c = rows->contiguous();
  at::Tensor out = at::empty({n_out, n_cols}, values.options());
  const int64_t* rows_ptr = rows_c.has_value() ? rows_c->data_ptr<int64_t>() : nullptr;
  const int elem_bytes = static_cast<int>(values_c.element_size());
  try {
    if constexpr (body == Body::cuda) {
      const EndorReport report = simt_bodies::run_endor_cuda(
          values_c.data_ptr(), elem_bytes, bitmap_c.data_ptr<uint8_t>(), offsets_c.data_ptr<int64_t>(), rows_ptr,
          bitmap_c.size(0), n_cols, values_c.numel(), n_out, out.data_ptr());
      check_endor_report(report, values_c, bitmap_c, offsets_c, n_cols, rows_c);
    } else {
      // What flashllm_ext.mlx checks on the host before dispatching the Metal kernel.
      const int64_t* offsets = offsets_c.data_ptr<int64_t>();
      check_endor_offset_ends(offsets[0], offsets[bitmap_c.size(0)], values_c.numel());
      if (n_out == 0) return out;
      at::Tensor status = at::empty({n_out}, values.options().dtype(at::kInt));
      simt_bodies::run_endor_metal(values_c.data_ptr(), elem_bytes, bitmap_c.data_ptr<uint8_t>(),
                                   offsets_c.data_ptr<int64_t>(), rows_ptr, bitmap_c.size(0), n_cols,
                                   values_c.numel(), n_out, out.data_ptr(), status.data_ptr<int32_t>());
      const at::Tensor bad = status.nonzero();
      if (bad.numel() > 0) {
        const int64_t o = bad[0][0].item<int64_t>();
        throw_endor_row_error(o, status[o].item<int32_t>(), values_c, bitmap_c, offsets_c, n_cols, rows_c);
      }
    }
  } catch (const std::runtime_error& e) {
    // A failed emulated launch (simt::LaunchError) is a kernel bug: say so rather than blame the input.
    TORCH_CHECK(false, "endor_decompress: SIMT emulation failed: ", e.what());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(flashllm_simt, m) {
  m.def("endor_decompress_cuda(Tensor values, Tensor bitmap, Tensor row_offsets, int n_cols, Tensor? rows=None) -> Tensor");
  m.def("endor_decompress_metal(Tensor values, Tensor bitmap, Tensor row_offsets, int n_cols, Tensor? rows=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(flashllm_simt, CPU, m) {
  m.impl("endor_decompress_cuda", &endor_decompress_simt<Body::cuda>);
  m.impl("endor_decompress_metal", &endor_decompress_simt<Body::metal>);
}

}  // namespace flashllm
