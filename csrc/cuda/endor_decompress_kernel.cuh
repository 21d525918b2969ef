// The CUDA Endor decompression kernel and its launcher: plain CUDA C++ over raw pointers. Included by
// endor_decompress.cu and, through the CPU SIMT emulation (csrc/simt/simt.h), by the test-only extension
// flashllm_ext._simt, which runs the same launcher with the emulation's launch policy. Include cuda_runtime.h or
// simt/simt.h first (dim3, cudaError_t).
//
// Layout (docs/design.md §5): row r's non-zeros are values[row_offsets[r] : row_offsets[r+1]] in column order; bit j of
// bitmap byte b of row r marks column 8b+j. W is an unsigned integer as wide as the element: the kernel moves bits.
//
// Design: one warp per output row, several warps per block, grid-stride over rows. Per step each lane takes one
// bitmap byte (8 columns); __popc and an in-warp inclusive scan give each lane the index of its first value; the
// lane writes its 8 elements with 16-byte stores (8-byte for int8) when the output row is aligned, scalar stores
// otherwise and past the last full byte. The walk (walk_row, endor_warp.cuh) gathers every value of
// kEndorStepsPerIter steps, and loads the next iteration's bitmap, before it stores any: one memory round trip per
// iteration rather than one per step.
//
// Safety: before reading a row's values the warp checks that the row index is in range, that row_offsets gives a
// range inside `values` and that no padding bit past n_cols is set; the walk reads no value past the range and
// counts the bits, and a row whose count differs from the range's length is rewritten as zeros. A bad row comes
// out as zeros and is reported through `report` (endor_codes.h), which also carries row_offsets[0] and
// row_offsets[n_rows] back for the host's check.
#pragma once

#include <cstdint>

#include "common/endor_codes.h"
#include "common/word_dispatch.h"
#include "cuda/endor_warp.cuh"

namespace flashllm {

constexpr int kEndorWarpsPerBlock = 8;
constexpr int kEndorThreadsPerBlock = kEndorWarpsPerBlock * 32;
constexpr int64_t kEndorMaxBlocks = int64_t(1) << 16;

// Blocks for n_out rows: one warp per row up to kEndorMaxBlocks, then warps loop over rows. At least one, which
// reports the first and last row offsets even when no row is asked for.
inline int64_t endor_grid_blocks(int64_t n_out) {
  const int64_t blocks = (n_out + kEndorWarpsPerBlock - 1) / kEndorWarpsPerBlock;
  return blocks < 1 ? 1 : blocks < kEndorMaxBlocks ? blocks : kEndorMaxBlocks;
}

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
    for (int s = 0; s < kWords / 4; ++s)
      v[s] = make_uint4(words[4 * s], words[4 * s + 1], words[4 * s + 2], words[4 * s + 3]);
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

// Zeros a refused row. `written` when the warp has already stored parts of it: the barrier orders those stores,
// made by other lanes, before these.
template <class W>
__device__ __forceinline__ void zero_row(W* __restrict__ dst, int64_t n_cols, int lane, bool written) {
  if (written) __syncwarp();
  for (int64_t c = lane; c < n_cols; c += 32) dst[c] = W(0);
}

}  // namespace endor_detail

// out[o, :] = row rows[o] (or o when rows is null) of the Endor tensor, for o in [0, n_out).
// Launch with kEndorThreadsPerBlock threads per block and endor_grid_blocks(n_out) blocks, report->bad_row set to
// kEndorNoError.
template <class W>
__global__ void __launch_bounds__(kEndorThreadsPerBlock)
    endor_decompress_kernel(const W* __restrict__ values, const uint8_t* __restrict__ bitmap,
                            const int64_t* __restrict__ row_offsets, const int64_t* __restrict__ rows, int64_t n_rows,
                            int64_t n_cols, int64_t nnz, int64_t n_out, W* __restrict__ out,
                            EndorReport* __restrict__ report) {
  using namespace endor_detail;
  const int lane = threadIdx.x % 32;
  const int64_t warps_per_block = blockDim.x / 32;
  const int64_t row_bytes = (n_cols + 7) / 8;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    report->first_offset = row_offsets[0];
    report->last_offset = row_offsets[n_rows];
  }
  for (int64_t o = int64_t(blockIdx.x) * warps_per_block + threadIdx.x / 32; o < n_out;
       o += int64_t(gridDim.x) * warps_per_block) {
    const int64_t r = rows != nullptr ? rows[o] : o;
    W* dst = out + o * n_cols;
    int64_t start = 0, length = 0;
    const int code = check_row_bounds(bitmap, row_offsets, r, n_rows, n_cols, nnz, start, length);
    if (code != kEndorRowOk) {
      // A refused row comes out as zeros rather than whatever `out` held: the CUDA glue reads the report back only
      // when kernel checks are on (common/kernel_checks.h).
      if (lane == 0) report_row(report, o, code);
      zero_row(dst, n_cols, lane, false);
      continue;
    }
    const bool aligned = reinterpret_cast<uintptr_t>(dst) % kStoreBytes<W> == 0;
    const int64_t used = walk_row(bitmap + r * row_bytes, 0, row_bytes, values + start, length, lane,
                                  [&](int64_t b0, const W(&e)[kEndorStepsPerIter][8]) {
#pragma unroll
                                    for (int s = 0; s < kEndorStepsPerIter; ++s)
                                      store_byte(e[s], dst, 8 * (b0 + 32 * s + lane), n_cols, aligned);
                                  });
    if (used != length) {
      if (lane == 0) report_row(report, o, kEndorRowCountMismatch);
      zero_row(dst, n_cols, lane, true);
    }
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
  return dispatch_word(elem_bytes, [&](auto word) {
    using W = decltype(word);
    return launch(endor_decompress_kernel<W>, dim3(static_cast<unsigned>(endor_grid_blocks(n_out))),
                  dim3(kEndorThreadsPerBlock), static_cast<const W*>(values), bitmap, row_offsets, rows, n_rows, n_cols,
                  nnz, n_out, static_cast<W*>(out), report);
  });
}

}  // namespace flashllm
