// What an Endor decompression kernel reports about the rows it refused to decode. Shared by the CUDA kernel, the
// host glue and the SIMT test build; metal/endor_decompress.metal writes the same numbers into its per-row status.
// The checks and their order are those of the CPU kernel (csrc/cpu/endor_decompress.cpp).
#pragma once
#include <cstdint>

namespace flashllm {

enum EndorRowCode : int {
  kEndorRowOk = 0,
  kEndorRowIndexOutOfRange = 1,  // rows[o] outside [0, n_rows)
  kEndorRowOffsetsInvalid = 2,   // row_offsets[r] .. row_offsets[r+1] is not a range inside values
  kEndorRowPaddingBits = 3,      // a bit past n_cols is set in the row's last bitmap byte
  kEndorRowCountMismatch = 4,    // row_offsets[r+1] - row_offsets[r] != popcount(bitmap row r)
};

constexpr unsigned long long kEndorNoError = ~0ull;
constexpr int kEndorCodeBits = 3;

// Written by the CUDA kernel, read back by the host in one copy. bad_row starts at kEndorNoError; the kernel
// atomicMin's (output row << kEndorCodeBits | code) into it, so it ends holding the lowest bad output row and why.
// The first and last row offsets ride along so the host checks row_offsets[0] == 0, row_offsets[R] == nnz without
// a second copy.
struct EndorReport {
  unsigned long long bad_row;
  int64_t first_offset;
  int64_t last_offset;
};

}  // namespace flashllm
