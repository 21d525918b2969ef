// Argument checks of the Endor ops (flashllm::endor_decompress, flashllm::endor_linear) shared by every native kernel
// (CPU, CUDA, SIMT test ops).
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

inline void check_same_device(const char* op, const at::Tensor& t, const char* name, const at::Tensor& values) {
  TORCH_CHECK(t.device() == values.device(), op, ": ", name, " is on ", t.device(), " but values is on ",
              values.device());
}

// The metadata checks of an Endor tensor's arrays every Endor op makes, after its own check of values' dtype; `op`
// names the op in the message.
inline void check_endor_tensor(const char* op, const at::Tensor& values, const at::Tensor& bitmap,
                               const at::Tensor& row_offsets, int64_t n_cols) {
  TORCH_CHECK(values.dim() == 1, op, ": values must be 1-D, got shape ", values.sizes());
  TORCH_CHECK(bitmap.scalar_type() == at::kByte && bitmap.dim() == 2, op, ": bitmap must be a 2-D uint8 tensor, got ",
              bitmap.scalar_type(), " of shape ", bitmap.sizes());
  TORCH_CHECK(n_cols >= 0 && bitmap.size(1) == (n_cols + 7) / 8, op, ": bitmap has ", bitmap.size(1),
              " bytes per row, n_cols=", n_cols, " needs ", (n_cols + 7) / 8);
  const int64_t n_rows = bitmap.size(0);
  TORCH_CHECK(row_offsets.scalar_type() == at::kLong && row_offsets.dim() == 1 && row_offsets.numel() == n_rows + 1, op,
              ": row_offsets must be int64 of length rows+1=", n_rows + 1, ", got ", row_offsets.scalar_type(),
              " of shape ", row_offsets.sizes());
  check_same_device(op, bitmap, "bitmap", values);
  check_same_device(op, row_offsets, "row_offsets", values);
}

// Returns the number of output rows.
inline int64_t check_endor_args(const at::Tensor& values, const at::Tensor& bitmap, const at::Tensor& row_offsets,
                                int64_t n_cols, const std::optional<at::Tensor>& rows, const at::Tensor* out) {
  TORCH_CHECK(is_endor_dtype(values.scalar_type()),
              "endor_decompress: values must be float32, float16, bfloat16 or int8, got ", values.scalar_type());
  check_endor_tensor("endor_decompress", values, bitmap, row_offsets, n_cols);
  int64_t n_out = bitmap.size(0);
  if (rows.has_value()) {
    check_same_device("endor_decompress", *rows, "rows", values);
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->dim() == 1,
                "endor_decompress: rows must be a 1-D int64 tensor, got ", rows->scalar_type(), " of shape ",
                rows->sizes());
    n_out = rows->numel();
  }
  if (out != nullptr) {
    check_same_device("endor_decompress", *out, "out", values);
    TORCH_CHECK(out->scalar_type() == values.scalar_type() && out->dim() == 2 && out->size(0) == n_out &&
                    out->size(1) == n_cols && out->is_contiguous(),
                "endor_decompress: out must be a contiguous ", values.scalar_type(), " tensor of shape [", n_out, ", ",
                n_cols, "], got ", out->scalar_type(), " of shape ", out->sizes());
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

// ---------------------------------------------------------------------------------------------- endor_linear
// Float element types endor_linear computes with; int8 values would need a scale the format does not carry.
inline bool is_endor_linear_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// The metadata checks of flashllm::endor_linear (flashllm_ext/ops/endor.py words them the same). Returns the number of
// rows of the weight (columns of y).
inline int64_t check_endor_linear_args(const at::Tensor& x, const at::Tensor& values, const at::Tensor& bitmap,
                                       const at::Tensor& row_offsets, int64_t n_cols,
                                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(is_endor_linear_dtype(values.scalar_type()),
              "endor_linear: values must be float32, float16 or bfloat16 (int8 is not supported: it needs a scale), "
              "got ",
              values.scalar_type());
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == values.scalar_type() || x.scalar_type() == at::kFloat),
              "endor_linear: x must be a 2-D ", values.scalar_type(), " or float32 tensor [T, n_cols], got ",
              x.scalar_type(), " of shape ", x.sizes());
  check_endor_tensor("endor_linear", values, bitmap, row_offsets, n_cols);
  TORCH_CHECK(x.size(1) == n_cols, "endor_linear: x has ", x.size(1), " columns but the weight has n_cols=", n_cols);
  const int64_t n_rows = bitmap.size(0);
  check_same_device("endor_linear", x, "x", values);
  if (bias.has_value()) {
    check_same_device("endor_linear", *bias, "bias", values);
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->dim() == 1 && bias->size(0) == n_rows,
                "endor_linear: bias must be ", x.scalar_type(), " of shape [rows=", n_rows, "], got ",
                bias->scalar_type(), " of shape ", bias->sizes());
  }
  return n_rows;
}

}  // namespace flashllm
