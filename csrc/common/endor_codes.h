// What an Endor decompression kernel reports about a row it refused to decode. Shared by the CUDA kernel, the host
// glue and the SIMT test build; metal/endor_decompress.metal writes the same numbers into its per-row status.
//
// The CUDA kernel folds (output row, code) into one 64-bit word, atomicMin'ed into a device word that starts at
// kEndorNoError, so the host learns the lowest bad output row and why.
#pragma once
#include <cstdint>

namespace flashllm {

enum EndorRowCode : int {
  kEndorRowOk = 0,
  kEndorRowIndexOutOfRange = 1,  // rows[o] outside [0, n_rows)
  kEndorRowOffsetsInvalid = 2,   // row_offsets[r] .. row_offsets[r+1] is not a range inside values
  kEndorRowCountMismatch = 3,    // row_offsets[r+1] - row_offsets[r] != popcount(bitmap row r)
};

constexpr unsigned long long kEndorNoError = ~0ull;
constexpr int kEndorCodeBits = 2;
}  // namespace flashllm
