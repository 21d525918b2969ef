// Turns what an Endor decompression kernel reported (endor_codes.h) into the RuntimeError the user sees. Host-side,
// shared by the CPU kernel, the CUDA glue and the SIMT test ops, so every backend words its errors alike; it reads
// the few numbers it names only on this error path.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>

#include "common/endor_codes.h"

namespace flashllm {

// The check the CPU kernel makes before decoding: row_offsets spans exactly `values`.
inline void check_endor_offset_ends(int64_t first, int64_t last, int64_t nnz) {
  TORCH_CHECK(first == 0 && last == nnz, "endor_decompress: row_offsets must start at 0 and end at values.numel()=",
              nnz, ", got ", first, "..", last);
}

[[noreturn]] inline void throw_endor_row_error(int64_t out_row, int code, const at::Tensor& values,
                                               const at::Tensor& bitmap, const at::Tensor& row_offsets,
                                               int64_t n_cols, const std::optional<at::Tensor>& rows) {
  const int64_t n_rows = bitmap.size(0);
  const int64_t r = rows.has_value() ? (*rows)[out_row].item<int64_t>() : out_row;
  TORCH_CHECK(code != kEndorRowIndexOutOfRange && r >= 0 && r < n_rows, "endor_decompress: rows[", out_row, "]=", r,
              " is outside [0, ", n_rows, ")");
  const int64_t start = row_offsets[r].item<int64_t>();
  const int64_t end = row_offsets[r + 1].item<int64_t>();
  TORCH_CHECK(code != kEndorRowOffsetsInvalid, "endor_decompress: row ", r, ": row_offsets [", start, ", ", end,
              ") is not a range inside values (", values.numel(), " elements)");
  TORCH_CHECK(code != kEndorRowPaddingBits, "endor_decompress: row ", r, ": bitmap has bits set past n_cols=", n_cols);
  if (code == kEndorRowCountMismatch) {
    const at::Tensor row_bits = bitmap[r].cpu();
    const uint8_t* bytes = row_bits.data_ptr<uint8_t>();
    int64_t set_bits = 0;
    for (int64_t b = 0; b < row_bits.numel(); ++b) set_bits += __builtin_popcount(bytes[b]);
    TORCH_CHECK(false, "endor_decompress: row ", r, ": row_offsets says ", end - start, " values but the bitmap has ",
                set_bits, " set bits");
  }
  TORCH_CHECK(false, "endor_decompress: kernel reported unknown code ", code, " for output row ", out_row);
}

// Raises for what a CUDA-style report holds: offsets not spanning values first (as the CPU kernel checks them before
// decoding), then the lowest bad output row.
inline void check_endor_report(const EndorReport& report, const at::Tensor& values, const at::Tensor& bitmap,
                               const at::Tensor& row_offsets, int64_t n_cols, const std::optional<at::Tensor>& rows) {
  check_endor_offset_ends(report.first_offset, report.last_offset, values.numel());
  if (report.bad_row == kEndorNoError) return;
  throw_endor_row_error(static_cast<int64_t>(report.bad_row >> kEndorCodeBits),
                        static_cast<int>(report.bad_row & ((1ull << kEndorCodeBits) - 1)), values, bitmap,
                        row_offsets, n_cols, rows);
}

}  // namespace flashllm
