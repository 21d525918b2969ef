// Turns what an Endor decompression kernel reported about a bad row (endor_codes.h) into the RuntimeError the user
// sees. Host-side, shared by the CUDA glue and the SIMT test ops; it reads the few numbers it names only on this
// error path.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>

#include "common/endor_codes.h"

namespace flashllm {

[[noreturn]] inline void throw_endor_row_error(int64_t out_row, int code, const at::Tensor& values,
                                               const at::Tensor& bitmap, const at::Tensor& row_offsets,
                                               const std::optional<at::Tensor>& rows) {
  const int64_t n_rows = bitmap.size(0);
  const int64_t r = rows.has_value() ? (*rows)[out_row].item<int64_t>() : out_row;
  if (code == kEndorRowIndexOutOfRange)
    TORCH_CHECK(false, "endor_decompress: rows[", out_row, "] = ", r, " is outside [0, ", n_rows, ")");
  TORCH_CHECK(r >= 0 && r < n_rows, "endor_decompress: kernel reported code ", code, " for row ", r,
              ", which is outside [0, ", n_rows, ")");
  const int64_t start = row_offsets[r].item<int64_t>();
  const int64_t end = row_offsets[r + 1].item<int64_t>();
  if (code == kEndorRowOffsetsInvalid) {
    TORCH_CHECK(start >= 0, "endor_decompress: row ", r, " starts at row_offsets[", r, "] = ", start, " < 0");
    TORCH_CHECK(start <= end, "endor_decompress: row_offsets must be non-decreasing, but row_offsets[", r,
                "] = ", start, " > row_offsets[", r + 1, "] = ", end);
    TORCH_CHECK(false, "endor_decompress: values is too short: row ", r, " ends at row_offsets[", r + 1, "] = ", end,
                " but values has ", values.numel(), " elements");
  }
  if (code == kEndorRowCountMismatch) {
    const at::Tensor row_bits = bitmap[r].cpu();
    const uint8_t* bytes = row_bits.data_ptr<uint8_t>();
    int64_t set_bits = 0;
    for (int64_t b = 0; b < row_bits.numel(); ++b) set_bits += __builtin_popcount(bytes[b]);
    TORCH_CHECK(false, "endor_decompress: row ", r, ": row_offsets says ", end - start,
                " values but the bitmap has ", set_bits, " set bits");
  }
  TORCH_CHECK(false, "endor_decompress: kernel reported unknown code ", code, " for output row ", out_row);
}

// Raises if a CUDA-style error word (lowest bad output row and its code) names a row.
inline void check_endor_error_word(unsigned long long word, const at::Tensor& values, const at::Tensor& bitmap,
                                   const at::Tensor& row_offsets, const std::optional<at::Tensor>& rows) {
  if (word == kEndorNoError) return;
  throw_endor_row_error(static_cast<int64_t>(word >> kEndorCodeBits),
                        static_cast<int>(word & ((1ull << kEndorCodeBits) - 1)), values, bitmap, row_offsets, rows);
}

}  // namespace flashllm
