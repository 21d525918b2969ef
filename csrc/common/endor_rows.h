// CPU helpers shared by the Endor kernels (csrc/cpu/endor_decompress.cpp, csrc/cpu/endor_linear.cpp): bitmap word
// loads, the per-row check made before any of a row's values is read, the set-bit walk of a row, the AVX2 rank
// tables, and the lowest refused row of a parallel loop.
#pragma once
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "common/endor_codes.h"

namespace flashllm {

template <typename T>
inline T load_word(const uint8_t* p) {  // fixed-size copy: compiles to one load, unlike a variable-size memcpy
  T m;
  std::memcpy(&m, p, sizeof(T));
  return m;
}

// Reads up to 8 bitmap bytes as a little-endian word without reading past `n_bytes` (for row tails only: the
// variable-size copy is a library call).
inline uint64_t load_mask_bytes(const uint8_t* p, int64_t n_bytes) {
  uint64_t m = 0;
  // The bitmap of a matrix without columns may be a null pointer, and memcpy from null is undefined even for 0 bytes.
  if (n_bytes > 0) std::memcpy(&m, p, static_cast<size_t>(std::min<int64_t>(n_bytes, 8)));
  return m;
}

// Set bits of one bitmap row; -1 when a padding bit past n_cols is set (the row would not decode to n_cols).
int64_t endor_row_popcount(const uint8_t* row_bitmap, int64_t n_cols);

// Why row r of the Endor tensor may not be read (an EndorRowCode), or kEndorRowOk with *start set to the row's first
// value: index in range, offsets a range inside values, no padding bit set, length equal to the popcount.
inline int endor_row_code(const uint8_t* bitmap, const int64_t* offsets, int64_t r, int64_t n_rows, int64_t n_cols,
                          int64_t nnz, int64_t* start) {
  if (r < 0 || r >= n_rows) return kEndorRowIndexOutOfRange;
  const int64_t first = offsets[r], end = offsets[r + 1];
  if (first < 0 || end < first || end > nnz) return kEndorRowOffsetsInvalid;
  const int64_t count = endor_row_popcount(bitmap + r * ((n_cols + 7) / 8), n_cols);
  if (count < 0) return kEndorRowPaddingBits;
  if (count != end - first) return kEndorRowCountMismatch;
  *start = first;
  return kEndorRowOk;
}

// Calls fn(column) for each set bit of a row's bitmap, in column order: the k-th call is for the row's k-th value.
template <class Fn>
inline void for_each_set_column(const uint8_t* row_bitmap, int64_t n_cols, Fn&& fn) {
  const int64_t n_bytes = (n_cols + 7) / 8;
  for (int64_t b = 0; b < n_bytes; b += 8) {
    uint64_t m = b + 8 <= n_bytes ? load_word<uint64_t>(row_bitmap + b) : load_mask_bytes(row_bitmap + b, n_bytes - b);
    while (m) {
      fn(b * 8 + __builtin_ctzll(m));
      m &= m - 1;
    }
  }
}

// For each bitmap byte: the rank of each set bit among the set bits (the source lane of each output lane), as the
// AVX2 paths' permutation and shuffle controls.
struct EndorAvx2Tables {
  alignas(32) std::array<std::array<int32_t, 8>, 256> perm32;      // 0 for unset lanes
  alignas(16) std::array<std::array<uint8_t, 16>, 256> shuffle16;  // pshufb indices, 0x80 = zero
  alignas(16) std::array<std::array<uint8_t, 16>, 256> shuffle8;
  EndorAvx2Tables();
};
const EndorAvx2Tables& endor_avx2_tables();

// The lowest refused output row of a parallel loop over rows and why, packed as EndorReport::bad_row
// (row << kEndorCodeBits | EndorRowCode), kEndorNoError when none.
class LowestBadRow {
 public:
  void note(int64_t out_row, int code) {
    const unsigned long long packed = static_cast<unsigned long long>(out_row) << kEndorCodeBits | code;
    unsigned long long seen = packed_.load(std::memory_order_relaxed);
    while (packed < seen && !packed_.compare_exchange_weak(seen, packed, std::memory_order_relaxed)) {
    }
  }
  unsigned long long packed() const { return packed_.load(std::memory_order_relaxed); }

 private:
  std::atomic<unsigned long long> packed_{kEndorNoError};
};

}  // namespace flashllm
