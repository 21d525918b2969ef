// Warp-level pieces shared by the Endor CUDA kernels (endor_decompress_kernel.cuh, endor_linear_kernel.cuh): sums
// and scans over a warp, and the per-row check a warp makes before reading any of a row's values. Plain CUDA C++;
// include cuda_runtime.h or simt/simt.h first.
#pragma once

#include <cstdint>

#include "common/endor_codes.h"

namespace flashllm {

// Bitmap steps (32 bytes, one per lane: 256 columns) a warp loads before it reads any value, so several steps' value
// loads are in flight at once.
constexpr int kEndorStepsPerIter = 4;

namespace endor_detail {

constexpr unsigned kFullMask = 0xffffffffu;

// The sum over the warp, in every lane.
template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(kFullMask, v, d);
  return v;
}

__device__ __forceinline__ unsigned warp_inclusive_scan(unsigned v, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const unsigned below = __shfl_up_sync(kFullMask, v, d);
    if (lane >= d) v += below;
  }
  return v;
}

// One iteration of a warp's walk over a row's bitmap: kEndorStepsPerIter steps from bitmap byte b0. Lane l holds
// byte b0 + 32 s + l of step s (0 past the row) and the index of that byte's first value, counted from the
// iteration's first value; `consumed` (the same in every lane) is the iteration's number of values.
struct BitmapIteration {
  unsigned bits[kEndorStepsPerIter];
  unsigned first[kEndorStepsPerIter];
  unsigned consumed;
};

__device__ __forceinline__ BitmapIteration load_bitmap_iteration(const uint8_t* __restrict__ row_bitmap,
                                                                 int64_t row_bytes, int64_t b0, int lane) {
  BitmapIteration it;
#pragma unroll
  for (int s = 0; s < kEndorStepsPerIter; ++s) {
    const int64_t b = b0 + 32 * s + lane;
    it.bits[s] = b < row_bytes ? row_bitmap[b] : 0u;
  }
  it.consumed = 0;
#pragma unroll
  for (int s = 0; s < kEndorStepsPerIter; ++s) {
    const unsigned count = __popc(it.bits[s]);
    const unsigned inclusive = warp_inclusive_scan(count, lane);
    it.first[s] = it.consumed + inclusive - count;
    it.consumed += __shfl_sync(kFullMask, inclusive, 31);
  }
  return it;
}

// Why row r may not be read, or kEndorRowOk, with the checks in the CPU kernel's order; on kEndorRowOk, `start`
// is the row's first value. Every argument is the same in all lanes, so the whole warp returns at the same check.
__device__ __forceinline__ int check_row(const uint8_t* __restrict__ bitmap, const int64_t* __restrict__ row_offsets,
                                         int64_t r, int64_t n_rows, int64_t n_cols, int64_t nnz, int lane,
                                         int64_t& start) {
  if (r < 0 || r >= n_rows) return kEndorRowIndexOutOfRange;
  start = row_offsets[r];
  const int64_t end = row_offsets[r + 1];
  if (start < 0 || start > end || end > nnz) return kEndorRowOffsetsInvalid;
  const int64_t row_bytes = (n_cols + 7) / 8;
  const uint8_t* row_bitmap = bitmap + r * row_bytes;
  if ((n_cols & 7) && (row_bitmap[row_bytes - 1] >> (n_cols & 7))) return kEndorRowPaddingBits;
  unsigned long long set_bits = 0;
  for (int64_t b = lane; b < row_bytes; b += 32) set_bits += __popc(row_bitmap[b]);
  if (warp_sum(set_bits) != static_cast<unsigned long long>(end - start)) return kEndorRowCountMismatch;
  return kEndorRowOk;
}

__device__ __forceinline__ void report_row(EndorReport* report, int64_t out_row, int code) {
  atomicMin(&report->bad_row,
            (static_cast<unsigned long long>(out_row) << kEndorCodeBits) | static_cast<unsigned long long>(code));
}

}  // namespace endor_detail
}  // namespace flashllm
