// Pieces shared by the Endor CUDA kernels (endor_decompress_kernel.cuh, endor_linear_kernel.cuh): how the warps of a
// block share rows, sums and scans over a warp, the checks a warp makes before reading a row, and the walk over a
// row's bitmap and values. Plain CUDA C++; include cuda_runtime.h or simt/simt.h first.
#pragma once

#include <cstdint>

#include "common/endor_codes.h"

namespace flashllm {

// Bitmap steps (32 bytes, one per lane: 256 columns) a warp takes per iteration of its walk over a row.
constexpr int kEndorStepsPerIter = 4;
constexpr int kEndorIterBytes = 32 * kEndorStepsPerIter;
constexpr int kEndorWarpsPerBlock = 8;
constexpr int kEndorThreadsPerBlock = kEndorWarpsPerBlock * 32;
constexpr int64_t kEndorMaxBlocks = int64_t(1) << 16;

// How the warps of a block share rows: a team of warps_per_row warps per row, each walking chunk_bytes of the row's
// bitmap (a whole number of iterations; the last warp's chunk may be shorter), rows_per_block teams per block.
// Splitting a row keeps the grid many waves deep. With one warp per row (80 registers: 3 blocks of 8 warps per SM),
// a 4096-row matrix is 1.3 waves of resident blocks on an H200's 132 SMs, and the H200 ran those matrices at
// 0.75-0.77x of a copy's speed against 0.88-0.90x for 11008 and 16384 rows (BENCHMARKS, twelfth session).
struct EndorRowSplit {
  int warps_per_row;
  int rows_per_block;
  int64_t chunk_bytes;
};

// The split for rows of row_bytes bitmap bytes: as many warps as iterations, up to a block's worth, each walking
// the same number of iterations.
__host__ __device__ inline EndorRowSplit endor_row_split(int64_t row_bytes) {
  const int64_t iters = row_bytes > kEndorIterBytes ? (row_bytes + kEndorIterBytes - 1) / kEndorIterBytes : 1;
  const int64_t per_warp = (iters + kEndorWarpsPerBlock - 1) / kEndorWarpsPerBlock;
  const int warps = static_cast<int>((iters + per_warp - 1) / per_warp);
  return {warps, kEndorWarpsPerBlock / warps, per_warp * kEndorIterBytes};
}

// Blocks for n_out rows split as `split`: one team per row up to kEndorMaxBlocks, then teams loop over rows. At
// least one, which reports the first and last row offsets even when no row is asked for.
inline int64_t endor_grid_blocks(int64_t n_out, const EndorRowSplit& split) {
  const int64_t blocks = (n_out + split.rows_per_block - 1) / split.rows_per_block;
  return blocks < 1 ? 1 : blocks < kEndorMaxBlocks ? blocks : kEndorMaxBlocks;
}

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

__device__ __forceinline__ void load_bitmap_bytes(const uint8_t* __restrict__ row_bitmap, int64_t end_byte,
                                                  int64_t b0, int lane, unsigned (&bits)[kEndorStepsPerIter]) {
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

// The number of set bits in bytes [b_begin, b_end) of a row's bitmap, in every lane.
__device__ __forceinline__ int64_t count_bits(const uint8_t* __restrict__ row_bitmap, int64_t b_begin, int64_t b_end,
                                              int lane) {
  unsigned count = 0;
  for (int64_t b = b_begin + lane; b < b_end; b += 32) count += __popc(static_cast<unsigned>(row_bitmap[b]));
  return warp_sum(static_cast<int64_t>(count));
}

// Where a team's chunks start: each warp gives its chunk's count (the same in all its lanes) and gets the counts of
// the chunks before its own (`before`) and of all its team's chunks (`total`). Block-wide: every thread of the block
// calls it the same number of times. `counts` is kEndorWarpsPerBlock of the block's shared memory.
struct ChunkPlace {
  int64_t before;
  int64_t total;
};

__device__ __forceinline__ ChunkPlace place_chunk(int64_t count, int warp, int part, int warps_per_row,
                                                  int64_t* counts) {
  __syncthreads();  // every warp has read the previous round's counts
  if (threadIdx.x % 32 == 0) counts[warp] = count;
  __syncthreads();
  ChunkPlace place{0, 0};
  for (int p = 0; p < warps_per_row; ++p) {
    const int64_t c = counts[warp - part + p];
    place.before += p < part ? c : 0;
    place.total += c;
  }
  return place;
}

// Why row r may not be read before its bitmap is counted (index, offsets, padding bits), or kEndorRowOk with the
// row's first value and its number of values. The count itself is the caller's to check, from its chunks' counts
// (place_chunk), and walk_row never reads past the count it is given. Every argument is the same in all lanes, so
// the warp agrees on the result.
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
template <class W, class Use>
__device__ __forceinline__ void walk_row(const uint8_t* __restrict__ row_bitmap, int64_t b_begin, int64_t b_end,
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
}

__device__ __forceinline__ void report_row(EndorReport* report, int64_t out_row, int code) {
  atomicMin(&report->bad_row,
            (static_cast<unsigned long long>(out_row) << kEndorCodeBits) | static_cast<unsigned long long>(code));
}

}  // namespace endor_detail
}  // namespace flashllm
