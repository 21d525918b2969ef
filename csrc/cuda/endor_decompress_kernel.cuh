// The CUDA Endor decompression kernel and its launcher: plain CUDA C++ over raw pointers. Included by
// endor_decompress.cu and, through the CPU SIMT emulation (csrc/simt/simt.h), by the test-only extension
// flashllm_ext._simt, which runs the same launcher with the emulation's launch policy. Include cuda_runtime.h or
// simt/simt.h first (dim3, cudaError_t).
//
// Layout (DESIGN.md §5): row r's non-zeros are values[row_offsets[r] : row_offsets[r+1]] in column order; bit j of
// bitmap byte b of row r marks column 8b+j. W is an unsigned integer as wide as the element: the kernel moves bits.
//
// Design: a team of warps per output row (EndorRowSplit, endor_warp.cuh: up to a block's 8 warps, each a chunk of
// whole iterations), teams grid-stride over rows. Each warp counts its chunk's bits; the team adds the counts up in
// shared memory, which gives each chunk its first value and the row's total. Per step each lane takes one bitmap
// byte (8 columns); __popc and an in-warp inclusive scan give each lane the index of its first value; the lane writes
// its 8 elements with 16-byte stores (8-byte for int8) when the output row is aligned, scalar stores otherwise and
// past the last full byte. The walk (walk_row, endor_warp.cuh) gathers every value of kEndorStepsPerIter steps, and
// loads the next iteration's bitmap, before it stores any: one memory round trip per iteration rather than one per
// step.
//
// Safety: before reading a row's values the team checks that the row index is in range, that row_offsets gives a
// range inside `values`, that no padding bit past n_cols is set and that the bitmap's count equals the range's
// length; the walk reads no value past its chunk's count. A bad row comes out as zeros and is reported through
// `report` (endor_codes.h), which also carries row_offsets[0] and row_offsets[n_rows] back for the host's check.
#pragma once

#include <cstdint>

#include "common/endor_codes.h"
#include "common/word_dispatch.h"
#include "cuda/endor_warp.cuh"

namespace flashllm {

namespace endor_detail {

// Bytes of one vector store: the 8 elements of a bitmap byte, at most 16.
template <class W>
constexpr int kStoreBytes = 8 * sizeof(W) < 16 ? 8 * sizeof(W) : 16;

// Writes 8 elements to 8*sizeof(W)-byte-aligned dst with vector stores (little-endian packing, as on GPU and x86).
template <class W>
__device__ __forceinline__ void store8_vector(W* dst, const W (&e)[8]) {
  constexpr int kWords = 2 * sizeof(W);
  uint32_t words[kWords];
#pragma unroll
  for (int i = 0; i < kWords; ++i) words[i] = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) words[j * sizeof(W) / 4] |= uint32_t(e[j]) << (8 * (j * sizeof(W) % 4));
  if constexpr (kWords >= 4) {
    uint4* v = reinterpret_cast<uint4*>(dst);
#pragma unroll
    for (int s = 0; s < kWords / 4; ++s) v[s] = make_uint4(words[4 * s], words[4 * s + 1], words[4 * s + 2], words[4 * s + 3]);
  } else {
    *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
  }
}

// Writes columns col..col+7 of an output row.
template <class W>
__device__ __forceinline__ void store_byte(const W (&e)[8], W* __restrict__ dst, int64_t col, int64_t n_cols,
                                           bool aligned) {
  if (aligned && col + 8 <= n_cols) {
    store8_vector(dst + col, e);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (col + j < n_cols) dst[col + j] = e[j];
  }
}

// Zeros columns [c_begin, c_end) of an output row (a refused row's part).
template <class W>
__device__ __forceinline__ void zero_cols(W* __restrict__ dst, int64_t c_begin, int64_t c_end, int lane) {
  for (int64_t c = c_begin + lane; c < c_end; c += 32) dst[c] = W(0);
}

}  // namespace endor_detail

// out[o, :] = row rows[o] (or o when rows is null) of the Endor tensor, for o in [0, n_out), each row walked by a team
// of `warps_per_row` warps, chunk_bytes of its bitmap each (EndorRowSplit). Launch with
// 32 * warps_per_row * rows_per_block threads per block and endor_grid_blocks(n_out, split) blocks, report->bad_row
// set to kEndorNoError.
template <class W>
__global__ void __launch_bounds__(kEndorThreadsPerBlock)
    endor_decompress_kernel(const W* __restrict__ values, const uint8_t* __restrict__ bitmap,
                            const int64_t* __restrict__ row_offsets, const int64_t* __restrict__ rows,
                            int64_t n_rows, int64_t n_cols, int64_t nnz, int64_t n_out, W* __restrict__ out,
                            int warps_per_row, int64_t chunk_bytes, EndorReport* __restrict__ report) {
  using namespace endor_detail;
  __shared__ int64_t chunk_counts[kEndorWarpsPerBlock];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int part = warp % warps_per_row;
  const int64_t rows_per_block = blockDim.x / 32 / warps_per_row;
  const int64_t row_bytes = (n_cols + 7) / 8;
  const int64_t b_begin = part * chunk_bytes;
  const int64_t b_end = b_begin + chunk_bytes < row_bytes ? b_begin + chunk_bytes : row_bytes;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    report->first_offset = row_offsets[0];
    report->last_offset = row_offsets[n_rows];
  }
  // Block-uniform loop: every thread reaches place_chunk's barriers.
  for (int64_t base = int64_t(blockIdx.x) * rows_per_block; base < n_out; base += int64_t(gridDim.x) * rows_per_block) {
    const int64_t o = base + warp / warps_per_row;
    const int64_t r = o < n_out ? (rows != nullptr ? rows[o] : o) : 0;
    int64_t start = 0, length = 0;
    int code = o < n_out ? check_row_bounds(bitmap, row_offsets, r, n_rows, n_cols, nnz, start, length) : kEndorRowOk;
    const uint8_t* row_bitmap = bitmap + (code == kEndorRowOk ? r : 0) * row_bytes;
    // The chunk's values start after those of the team's earlier chunks: each warp counts its own, then the team
    // adds them up. The whole row's count is known before any value is read, so a row whose bitmap disagrees with
    // its offsets is never walked.
    const int64_t count = o < n_out && code == kEndorRowOk ? count_bits(row_bitmap, b_begin, b_end, lane) : 0;
    const ChunkPlace place = place_chunk(count, warp, part, warps_per_row, chunk_counts);
    if (o >= n_out) continue;
    W* dst = out + o * n_cols;
    if (code == kEndorRowOk && place.total != length) code = kEndorRowCountMismatch;
    if (code != kEndorRowOk) {
      // A refused row comes out as zeros rather than whatever `out` held: the CUDA glue reads the report back only
      // when kernel checks are on (common/kernel_checks.h).
      if (part == 0 && lane == 0) report_row(report, o, code);
      zero_cols(dst, 8 * b_begin, 8 * b_end < n_cols ? 8 * b_end : n_cols, lane);
      continue;
    }
    const bool aligned = reinterpret_cast<uintptr_t>(dst) % kStoreBytes<W> == 0;
    walk_row(row_bitmap, b_begin, b_end, values + start + place.before, count, lane,
             [&](int64_t b0, const W (&e)[kEndorStepsPerIter][8]) {
#pragma unroll
               for (int s = 0; s < kEndorStepsPerIter; ++s)
                 store_byte(e[s], dst, 8 * (b0 + 32 * s + lane), n_cols, aligned);
             });
  }
}

// Decompresses n_out rows of an Endor tensor into the contiguous [n_out, n_cols] `out` through `launch` (a launch
// policy: CudaLaunch, simt::EmulatedLaunch). elem_bytes is 1, 2 or 4: elements are moved as bits. rows may be null
// (all rows, n_out == n_rows). `report` is memory of the kernel's device that this initialises; once the kernel has
// run, it says which rows were refused (EndorReport, endor_codes.h).
template <class Launch>
cudaError_t launch_endor_decompress(const Launch& launch, const void* values, int elem_bytes, const uint8_t* bitmap,
                                    const int64_t* row_offsets, const int64_t* rows, int64_t n_rows, int64_t n_cols,
                                    int64_t nnz, int64_t n_out, void* out, EndorReport* report) {
  if (elem_bytes != 1 && elem_bytes != 2 && elem_bytes != 4) return cudaErrorInvalidValue;
  const cudaError_t reset = launch.fill_bytes(&report->bad_row, 0xff, sizeof(report->bad_row));  // kEndorNoError
  if (reset != cudaSuccess) return reset;
  const EndorRowSplit split = endor_row_split((n_cols + 7) / 8);
  return dispatch_word(elem_bytes, [&](auto word) {
    using W = decltype(word);
    return launch(endor_decompress_kernel<W>, dim3(static_cast<unsigned>(endor_grid_blocks(n_out, split))),
                  dim3(static_cast<unsigned>(32 * split.warps_per_row * split.rows_per_block)),
                  static_cast<const W*>(values), bitmap, row_offsets, rows, n_rows, n_cols, nnz, n_out,
                  static_cast<W*>(out), split.warps_per_row, split.chunk_bytes, report);
  });
}

}  // namespace flashllm
