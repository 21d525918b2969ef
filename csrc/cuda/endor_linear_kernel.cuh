// The CUDA kernel of flashllm::endor_linear and its launcher: y = x W^T (+ bias) from an Endor tensor W, never
// materialising W. Plain CUDA C++ over raw pointers. Included by endor_linear.cu and, through the CPU SIMT emulation
// (csrc/simt/simt.h), by flashllm_ext._simt, which runs the same launcher with the emulation's launch policy.
// Include cuda_runtime.h or simt/simt.h first (dim3, cudaError_t).
//
// Design: one warp per weight row (kEndorWarpsPerBlock rows per block, grid-stride over row groups), up to
// kLinearMaxTokens tokens per launch (the launcher loops over groups of tokens). The block stages a tile of x (float32,
// all its tokens) in shared memory; per tile each warp walks its row's bitmap as endor_decompress does (a byte of 8
// columns per lane, kEndorStepsPerIter steps loaded before any value, in-warp prefix popcounts giving each lane its
// first value: endor_warp.cuh), gathers its values (coalesced across the warp: a step's values are contiguous) and
// FMAs them against the 8 staged columns of every token, which it reads as two 16-byte shared loads. Each lane keeps
// one float32 partial sum per token; warp sums finish the row. Values: KIND (FfnKind) float32, float16 or bfloat16.
//
// Safety: before reading a row's values the warp makes endor_decompress's checks (check_row). A refused row is
// written as zeros (no bias) and reported through `report` (endor_codes.h), which also carries row_offsets[0] and
// row_offsets[n_rows] back for the host's check.
#pragma once

#include <cstdint>

#include "common/endor_codes.h"
#include "common/ffn_grid.h"
#include "common/half_bits.h"
#include "cuda/endor_decompress_kernel.cuh"
#include "cuda/endor_warp.cuh"

namespace flashllm {

constexpr int kLinearMaxTokens = 8;
// The x tile: 8192 floats (32 KiB of static shared memory), as many columns as fit for the launch's tokens, in
// multiples of one warp iteration (kEndorStepsPerIter steps of 256 columns).
constexpr int kLinearTileFloats = 8192;
constexpr int kLinearIterCols = 256 * kEndorStepsPerIter;
static_assert(kLinearTileFloats / kLinearMaxTokens >= kLinearIterCols, "the tile holds one iteration per token");

__host__ __device__ inline int64_t linear_tile_cols(int n_tok) {
  return int64_t(kLinearTileFloats) / (n_tok > 0 ? n_tok : 1) / kLinearIterCols * kLinearIterCols;
}

// y[t * n_rows + r] = sum_c W[r, c] x[t * n_cols + c] (+ bias[r]) for t < n_tok <= kLinearMaxTokens.
// Launch with kEndorThreadsPerBlock threads and endor_grid_blocks(n_rows) blocks, report->bad_row set to
// kEndorNoError.
template <int KIND>
__global__ void __launch_bounds__(kEndorThreadsPerBlock)
    endor_linear_kernel(const float* __restrict__ x, int n_tok, const ffn_detail::Storage<KIND>* __restrict__ values,
                        const uint8_t* __restrict__ bitmap, const int64_t* __restrict__ row_offsets, int64_t n_rows,
                        int64_t n_cols, int64_t nnz, const float* __restrict__ bias, float* __restrict__ y,
                        EndorReport* __restrict__ report) {
  using namespace endor_detail;
  using ffn_detail::bits_to_float;
  // uint4 words, so a lane reads its 8 columns of a token with two aligned 16-byte loads.
  __shared__ uint4 x_tile_words[kLinearTileFloats / 4];
  float* x_tile = reinterpret_cast<float*>(x_tile_words);
  const int lane = threadIdx.x % 32;
  const int64_t warps_per_block = blockDim.x / 32;
  const int64_t row_bytes = (n_cols + 7) / 8;
  const int64_t tile_cols = linear_tile_cols(n_tok);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    report->first_offset = row_offsets[0];
    report->last_offset = row_offsets[n_rows];
  }
  // Block-uniform loops (row groups, tiles): every thread reaches every barrier.
  for (int64_t base = int64_t(blockIdx.x) * warps_per_block; base < n_rows;
       base += int64_t(gridDim.x) * warps_per_block) {
    const int64_t r = base + threadIdx.x / 32;
    int64_t start = 0;
    const int code = r < n_rows ? check_row(bitmap, row_offsets, r, n_rows, n_cols, nnz, lane, start) : kEndorRowOk;
    const bool active = r < n_rows && code == kEndorRowOk;
    if (r < n_rows && code != kEndorRowOk && lane == 0) report_row(report, r, code);
    const uint8_t* row_bitmap = bitmap + (active ? r : 0) * row_bytes;
    const ffn_detail::Storage<KIND>* row_values = values + start;
    float acc[kLinearMaxTokens] = {};
    for (int64_t tile0 = 0; tile0 < n_cols; tile0 += tile_cols) {
      const int64_t cols = n_cols - tile0 < tile_cols ? n_cols - tile0 : tile_cols;
      __syncthreads();  // every warp is done with the previous tile
      for (int64_t i = threadIdx.x; i < n_tok * tile_cols; i += blockDim.x) {
        const int64_t t = i / tile_cols, c = i % tile_cols;
        x_tile[i] = c < cols ? x[t * n_cols + tile0 + c] : 0.f;  // zeros past n_cols: unset bits meet them
      }
      __syncthreads();
      if (!active) continue;
      for (int64_t g0 = 0; g0 < cols; g0 += kLinearIterCols) {
        const BitmapIteration it = load_bitmap_iteration(row_bitmap, row_bytes, (tile0 + g0) / 8, lane);
#pragma unroll
        for (int s = 0; s < kEndorStepsPerIter; ++s) {
          const unsigned bits = it.bits[s];
          if (bits == 0) continue;
          float w[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const unsigned k = it.first[s] + __popc(bits & ((1u << j) - 1u));  // the rank of bit j in the row
            w[j] = (bits >> j & 1u) ? ffn_detail::to_float<KIND>(row_values[k]) : 0.f;
          }
          const int64_t col = g0 + 256 * s + 8 * lane;  // in the tile; < tile_cols (tiles hold whole iterations)
#pragma unroll
          for (int t = 0; t < kLinearMaxTokens; ++t) {
            if (t < n_tok) {
              const uint4 lo = x_tile_words[(t * tile_cols + col) / 4];
              const uint4 hi = x_tile_words[(t * tile_cols + col) / 4 + 1];
              acc[t] += w[0] * bits_to_float(lo.x) + w[1] * bits_to_float(lo.y) + w[2] * bits_to_float(lo.z) +
                        w[3] * bits_to_float(lo.w) + w[4] * bits_to_float(hi.x) + w[5] * bits_to_float(hi.y) +
                        w[6] * bits_to_float(hi.z) + w[7] * bits_to_float(hi.w);
            }
          }
        }
        row_values += it.consumed;
      }
    }
    if (r >= n_rows) continue;
    // A refused row comes out as zeros: the CUDA glue reads the report back only when kernel checks are on.
    const float b = active && bias != nullptr ? bias[r] : 0.f;
#pragma unroll
    for (int t = 0; t < kLinearMaxTokens; ++t) {
      const float sum = warp_sum(acc[t]);
      if (lane == 0 && t < n_tok) y[t * n_rows + r] = active ? sum + b : 0.f;
    }
  }
}

// y [n_tok, n_rows] = x [n_tok, n_cols] W^T (+ bias) through `launch` (a launch policy: CudaLaunch,
// simt::EmulatedLaunch), in launches of at most kLinearMaxTokens tokens. x, bias and y are float32 and contiguous;
// values are of `kind` (FfnKind); bias may be null. `report` is memory of the kernel's device that this initialises;
// once the kernels have run, it says which rows were refused (EndorReport, endor_codes.h).
template <class Launch>
cudaError_t launch_endor_linear(const Launch& launch, const float* x, int64_t n_tok, const void* values, int kind,
                                const uint8_t* bitmap, const int64_t* row_offsets, int64_t n_rows, int64_t n_cols,
                                int64_t nnz, const float* bias, float* y, EndorReport* report) {
  if (kind != kFfnF32 && kind != kFfnF16 && kind != kFfnBF16) return cudaErrorInvalidValue;
  const cudaError_t reset = launch.fill_bytes(&report->bad_row, 0xff, sizeof(report->bad_row));  // kEndorNoError
  if (reset != cudaSuccess) return reset;
  const dim3 grid(static_cast<unsigned>(endor_grid_blocks(n_rows))), block(kEndorThreadsPerBlock);
  // One launch even for no tokens: the kernel reports the row offsets the host checks.
  for (int64_t t0 = 0; t0 == 0 || t0 < n_tok; t0 += kLinearMaxTokens) {
    const int nt = static_cast<int>(n_tok - t0 < kLinearMaxTokens ? n_tok - t0 : kLinearMaxTokens);
    cudaError_t status;
    if (kind == kFfnF32)
      status = launch(endor_linear_kernel<kFfnF32>, grid, block, x + t0 * n_cols, nt,
                      static_cast<const float*>(values), bitmap, row_offsets, n_rows, n_cols, nnz, bias,
                      y + t0 * n_rows, report);
    else if (kind == kFfnF16)
      status = launch(endor_linear_kernel<kFfnF16>, grid, block, x + t0 * n_cols, nt,
                      static_cast<const uint16_t*>(values), bitmap, row_offsets, n_rows, n_cols, nnz, bias,
                      y + t0 * n_rows, report);
    else
      status = launch(endor_linear_kernel<kFfnBF16>, grid, block, x + t0 * n_cols, nt,
                      static_cast<const uint16_t*>(values), bitmap, row_offsets, n_rows, n_cols, nnz, bias,
                      y + t0 * n_rows, report);
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

}  // namespace flashllm
