// Turns what an Endor kernel reported (endor_codes.h) into the RuntimeError the user sees. Host-side, shared by the
// CPU kernels, the CUDA glue and the SIMT test ops of every Endor op (`op` names it), so every backend words its
// errors alike; it reads the few numbers it names only on this error path.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>

#include "common/endor_codes.h"

namespace flashllm {

// The check the CPU kernels make before decoding: row_offsets spans exactly `values`.
inline void check_endor_offset_ends(const char* op, int64_t first, int64_t last, int64_t nnz) {
  TORCH_CHECK(first == 0 && last == nnz, op, ": row_offsets must start at 0 and end at values.numel()=", nnz, ", got ",
              first, "..", last);
}

// out_row is the output row the kernel refused: row rows[out_row] of the weight, or row out_row without `rows`.
[[noreturn]] inline void throw_endor_row_error(const char* op, int64_t out_row, int code, const at::Tensor& values,
                                               const at::Tensor& bitmap, const at::Tensor& row_offsets, int64_t n_cols,
                                               const std::optional<at::Tensor>& rows) {
  const int64_t n_rows = bitmap.size(0);
  const int64_t r = rows.has_value() ? (*rows)[out_row].item<int64_t>() : out_row;
  TORCH_CHECK(code != kEndorRowIndexOutOfRange && r >= 0 && r < n_rows, op, ": rows[", out_row, "]=", r,
              " is outside [0, ", n_rows, ")");
  const int64_t start = row_offsets[r].item<int64_t>();
  const int64_t end = row_offsets[r + 1].item<int64_t>();
  TORCH_CHECK(code != kEndorRowOffsetsInvalid, op, ": row ", r, ": row_offsets [", start, ", ", end,
              ") is not a range inside values (", values.numel(), " elements)");
  TORCH_CHECK(code != kEndorRowPaddingBits, op, ": row ", r, ": bitmap has bits set past n_cols=", n_cols);
  if (code == kEndorRowCountMismatch) {
    const at::Tensor row_bits = bitmap[r].cpu();
    const uint8_t* bytes = row_bits.data_ptr<uint8_t>();
    int64_t set_bits = 0;
    for (int64_t b = 0; b < row_bits.numel(); ++b) set_bits += __builtin_popcount(bytes[b]);
    TORCH_CHECK(false, op, ": row ", r, ": row_offsets says ", end - start, " values but the bitmap has ", set_bits,
                " set bits");
  }
  TORCH_CHECK(false, op, ": kernel reported unknown code ", code, " for output row ", out_row);
}

// Raises for a packed bad row (EndorReport::bad_row: out_row << kEndorCodeBits | code); nothing for kEndorNoError.
inline void throw_if_endor_bad_row(const char* op, unsigned long long bad_row, const at::Tensor& values,
                                   const at::Tensor& bitmap, const at::Tensor& row_offsets, int64_t n_cols,
                                   const std::optional<at::Tensor>& rows) {
  if (bad_row == kEndorNoError) return;
  throw_endor_row_error(op, static_cast<int64_t>(bad_row >> kEndorCodeBits),
                        static_cast<int>(bad_row & ((1ull << kEndorCodeBits) - 1)), values, bitmap, row_offsets, n_cols,
                        rows);
}

// Raises for what a CUDA-style report holds: offsets not spanning values first (as the CPU kernels check them before
// decoding), then the lowest bad output row.
inline void check_endor_report(const char* op, const EndorReport& report, const at::Tensor& values,
                               const at::Tensor& bitmap, const at::Tensor& row_offsets, int64_t n_cols,
                               const std::optional<at::Tensor>& rows) {
  check_endor_offset_ends(op, report.first_offset, report.last_offset, values.numel());
  throw_if_endor_bad_row(op, report.bad_row, values, bitmap, row_offsets, n_cols, rows);
}

}  // namespace flashllm
