// Argument checks of flashllm::endor_decompress shared by every native kernel (CPU, CUDA, SIMT test ops).
//
// Only metadata is checked here (dtypes, ranks, shapes, devices): it costs nothing. The data checks (row offsets
// inside `values`, each row's count equal to its bitmap popcount, row indices in range) are made by the kernels
// themselves as they decode, before reading a row's values, so no kernel ever reads out of bounds.
#pragma once
#include <torch/library.h>
#include <ATen/ATen.h>

#include <optional>

namespace flashllm {

inline bool is_endor_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kChar;
}

// Returns the number of output rows.
inline int64_t check_endor_args(const at::Tensor& values, const at::Tensor& bitmap, const at::Tensor& row_offsets,
                                int64_t n_cols, const std::optional<at::Tensor>& rows, const at::Tensor* out) {
  TORCH_CHECK(is_endor_dtype(values.scalar_type()),
              "endor_decompress: values must be float32, float16, bfloat16 or int8, got ", values.scalar_type());
  TORCH_CHECK(values.dim() == 1, "endor_decompress: values must be 1-D, got shape ", values.sizes());
  TORCH_CHECK(bitmap.scalar_type() == at::kByte && bitmap.dim() == 2,
              "endor_decompress: bitmap must be a 2-D uint8 tensor, got ", bitmap.scalar_type(), " of shape ",
              bitmap.sizes());
  TORCH_CHECK(n_cols >= 0 && bitmap.size(1) == (n_cols + 7) / 8, "endor_decompress: bitmap has ", bitmap.size(1),
              " bytes per row, n_cols=", n_cols, " needs ", (n_cols + 7) / 8);
  const int64_t n_rows = bitmap.size(0);
  TORCH_CHECK(row_offsets.scalar_type() == at::kLong && row_offsets.dim() == 1 && row_offsets.numel() == n_rows + 1,
              "endor_decompress: row_offsets must be int64 of length rows+1=", n_rows + 1, ", got ",
              row_offsets.scalar_type(), " of shape ", row_offsets.sizes());
  auto same_device = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.device() == values.device(), "endor_decompress: ", name, " is on ", t.device(),
                " but values is on ", values.device());
  };
  same_device(bitmap, "bitmap");
  same_device(row_offsets, "row_offsets");
  int64_t n_out = n_rows;
  if (rows.has_value()) {
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->dim() == 1,
                "endor_decompress: rows must be a 1-D int64 tensor, got ", rows->scalar_type(), " of shape ",
                rows->sizes());
    same_device(*rows, "rows");
    n_out = rows->numel();
  }
  if (out != nullptr) {
    same_device(*out, "out");
    TORCH_CHECK(out->scalar_type() == values.scalar_type() && out->dim() == 2 && out->size(0) == n_out &&
                    out->size(1) == n_cols && out->is_contiguous(),
                "endor_decompress: out must be a contiguous ", values.scalar_type(), " tensor of shape [", n_out,
                ", ", n_cols, "], got ", out->scalar_type(), " of shape ", out->sizes());
  }
  return n_out;
}

using EndorDecompressOut = void (*)(const at::Tensor& values, const at::Tensor& bitmap, const at::Tensor& row_offsets,
                                    int64_t n_cols, const std::optional<at::Tensor>& rows, at::Tensor out);

// The functional form of a native kernel: allocates the output, then runs the kernel's .out form.
template <EndorDecompressOut kOut>
at::Tensor endor_decompress_allocating(const at::Tensor& values, const at::Tensor& bitmap,
                                       const at::Tensor& row_offsets, int64_t n_cols,
                                       const std::optional<at::Tensor>& rows) {
  const int64_t n_out = check_endor_args(values, bitmap, row_offsets, n_cols, rows, nullptr);
  at::Tensor out = at::empty({n_out, n_cols}, values.options());
  kOut(values, bitmap, row_offsets, n_cols, rows, out);
  return out;
}

}  // namespace flashllm
