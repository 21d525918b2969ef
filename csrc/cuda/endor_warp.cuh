// Warp-level pieces shared by the Endor CUDA kernels (endor_decompress_kernel.cuh, endor_linear_kernel.cuh): sums
// and scans over a warp, the checks a warp makes before reading a row, and the walk over a row's bitmap and values.
// Plain CUDA C++; include cuda_runtime.h or simt/simt.h first.
#pragma once

#include <cstdint>

#include "common/endor_codes.h"

namespace flashllm {

// Bitmap steps (32 bytes, one per lane: 256 columns) a warp takes per iteration of its walk over a row.
constexpr int kEndorStepsPerIter = 4;
constexpr int kEndorIterBytes = 32 * kEndorStepsPerIter;

namespace endor_detail {

constexpr unsigned kFullMask = 0xffffffffu;

// The sum over the warp, in every lane.
template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(kFullMask, v, d);
  return v;
}

template <class T>
__device__ __forceinline__ T warp_inclusive_scan(T v, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const T below = __shfl_up_sync(kFullMask, v, d);
    if (lane >= d) v += below;
  }
  return v;
}

// One iteration of a warp's walk over a row's bitmap: kEndorStepsPerIter steps. Lane l holds byte b0 + 32 s + l of
// step s (0 past the walk's end) and the index of that byte's first value, counted from the iteration's first
// value; `consumed` (the same in every lane) is the iteration's number of values.
struct BitmapIteration {
  unsigned bits[kEndorStepsPerIter];
  unsigned first[kEndorStepsPerIter];
  unsigned consumed;
};

__device__ __forceinline__ void load_bitmap_bytes(const uint8_t* __restrict__ row_bitmap, int64_t end_byte, int64_t b0,
                                                  int lane, unsigned (&bits)[kEndorStepsPerIter]) {
#pragma unroll
  for (int s = 0; s < kEndorStepsPerIter; ++s) {
    const int64_t b = b0 + 32 * s + lane;
    bits[s] = b < end_byte ? row_bitmap[b] : 0u;
  }
}

// One scan for all steps: each step's count (at most 8 per lane, 256 per warp) takes 16 bits of a 64-bit word.
__device__ __forceinline__ BitmapIteration scan_bitmap(const unsigned (&bits)[kEndorStepsPerIter], int lane) {
  static_assert(kEndorStepsPerIter <= 4, "four 16-bit counts per 64-bit scan word");
  BitmapIteration it;
  unsigned long long counts = 0;
#pragma unroll
  for (int s = 0; s < kEndorStepsPerIter; ++s) {
    it.bits[s] = bits[s];
    counts |= static_cast<unsigned long long>(__popc(bits[s])) << (16 * s);
  }
  const unsigned long long inclusive = warp_inclusive_scan(counts, lane);
  const unsigned long long totals = __shfl_sync(kFullMask, inclusive, 31);
  const unsigned long long exclusive = inclusive - counts;
  it.consumed = 0;
#pragma unroll
  for (int s = 0; s < kEndorStepsPerIter; ++s) {
    it.first[s] = it.consumed + static_cast<unsigned>(exclusive >> (16 * s) & 0xffffu);
    it.consumed += static_cast<unsigned>(totals >> (16 * s) & 0xffffu);
  }
  return it;
}

// Why row r may not be read before its bitmap is counted (index, offsets, padding bits), or kEndorRowOk with the
// row's first value and its number of values. The count itself is checked as the row is walked (walk_row), which
// never reads past the row's values. Every argument is the same in all lanes, so the warp agrees on the result.
__device__ __forceinline__ int check_row_bounds(const uint8_t* __restrict__ bitmap,
                                                const int64_t* __restrict__ row_offsets, int64_t r, int64_t n_rows,
                                                int64_t n_cols, int64_t nnz, int64_t& start, int64_t& length) {
  if (r < 0 || r >= n_rows) return kEndorRowIndexOutOfRange;
  const int64_t row_bytes = (n_cols + 7) / 8;
  start = row_offsets[r];
  const int64_t end = row_offsets[r + 1];
  const unsigned last = (n_cols & 7) ? bitmap[r * row_bytes + row_bytes - 1] : 0u;
  if (start < 0 || start > end || end > nnz) return kEndorRowOffsetsInvalid;
  if (last >> (n_cols & 7)) return kEndorRowPaddingBits;
  length = end - start;
  return kEndorRowOk;
}

// Walks bytes [b_begin, b_end) of a row's bitmap (b_begin a multiple of kEndorIterBytes) and the values they mark,
// which start at row_values, one iteration at a time. Per iteration it gathers every value the iteration's bits
// mark before using any (all the loads in flight at once), issues the next iteration's bitmap loads, then calls
// use(b0, e): e[s][j] is the value of bit j of the lane's byte b0 + 32 s + lane, zero where the bit is unset. Values
// at or past `length` are never read (they read as zero: an inconsistent bitmap costs a refusal, not a fault).
// Returns the number of values the bitmap marked, for the caller's count check.
template <class W, class Use>
__device__ __forceinline__ int64_t walk_row(const uint8_t* __restrict__ row_bitmap, int64_t b_begin, int64_t b_end,
                                            const W* __restrict__ row_values, int64_t length, int lane, Use&& use) {
  unsigned bits[kEndorStepsPerIter];
  load_bitmap_bytes(row_bitmap, b_end, b_begin, lane, bits);
  int64_t used = 0;
  for (int64_t b0 = b_begin; b0 < b_end; b0 += kEndorIterBytes) {
    const BitmapIteration it = scan_bitmap(bits, lane);
    const int64_t left = length - used;
    W e[kEndorStepsPerIter][8];
#pragma unroll
    for (int s = 0; s < kEndorStepsPerIter; ++s) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int64_t k = it.first[s] + __popc(it.bits[s] & ((1u << j) - 1u));  // the rank of bit j in the walk
        e[s][j] = (it.bits[s] >> j & 1u) && k < left ? row_values[used + k] : W(0);
      }
    }
    load_bitmap_bytes(row_bitmap, b_end, b0 + kEndorIterBytes, lane, bits);
    use(b0, e);
    used += it.consumed;
  }
  return used;
}

__device__ __forceinline__ void report_row(EndorReport* report, int64_t out_row, int code) {
  atomicMin(&report->bad_row,
            (static_cast<unsigned long long>(out_row) << kEndorCodeBits) | static_cast<unsigned long long>(code));
}

}  // namespace endor_detail
}  // namespace flashllm
