// The CUDA kernel of flashllm::endor_linear and its launcher: y = x W^T (+ bias) from an Endor tensor W, never
// materialising W. Plain CUDA C++ over raw pointers. Included by endor_linear.cu and, through the CPU SIMT emulation
// (csrc/simt/simt.h), by flashllm_ext._simt, which runs the same launcher with the emulation's launch policy.
// Include cuda_runtime.h or simt/simt.h first (dim3, cudaError_t).
//
// Design: one warp per weight row (kEndorWarpsPerBlock rows per block, grid-stride over row groups), up to
// kLinearMaxTokens tokens per launch (the launcher loops over groups of tokens; one token, the decode step, has its
// own instance with one accumulator). The block stages a tile of x (float32, all its tokens) in shared memory: once
// per launch when the tile holds all of x, once per row group otherwise. Per tile each warp walks its row as
// endor_decompress does (walk_row, endor_warp.cuh: a byte of 8 columns per lane, every value of kEndorStepsPerIter
// steps gathered before any is used) and FMAs the values against the 8 staged columns of every token, which it reads
// as two 16-byte shared loads. Each lane keeps one float32 partial sum per token; warp sums finish the row. Values:
// KIND (FfnKind) float32, float16 or bfloat16.
//
// Safety: the warp makes endor_decompress's checks (check_row_bounds before the walk, the count after it). A refused
// row is written as zeros (no bias) and reported through `report` (endor_codes.h), which also carries
// row_offsets[0] and row_offsets[n_rows] back for the host's check.
#pragma once

#include <cstdint>
#include <type_traits>

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

// y[t * n_rows + r] = sum_c W[r, c] x[t * n_cols + c] (+ bias[r]) for t < n_tok <= MAX_TOK <= kLinearMaxTokens.
// Launch with kEndorThreadsPerBlock threads and endor_grid_blocks(n_rows) blocks, report->bad_row set to
// kEndorNoError.
template <int KIND, int MAX_TOK>
__global__ void __launch_bounds__(kEndorThreadsPerBlock)
    endor_linear_kernel(const float* __restrict__ x, int n_tok, const ffn_detail::Storage<KIND>* __restrict__ values,
                        const uint8_t* __restrict__ bitmap, const int64_t* __restrict__ row_offsets, int64_t n_rows,
                        int64_t n_cols, int64_t nnz, const float* __restrict__ bias, float* __restrict__ y,
                        EndorReport* __restrict__ report) {
  using namespace endor_detail;
  using ffn_detail::bits_to_float;
  using Value = ffn_detail::Storage<KIND>;
  static_assert(MAX_TOK <= kLinearMaxTokens, "the tile holds one iteration per token");
  // uint4 words, so a lane reads its 8 columns of a token with two aligned 16-byte loads.
  __shared__ uint4 x_tile_words[kLinearTileFloats / 4];
  float* x_tile = reinterpret_cast<float*>(x_tile_words);
  const int lane = threadIdx.x % 32;
  const int64_t warps_per_block = blockDim.x / 32;
  const int64_t row_bytes = (n_cols + 7) / 8;
  const int64_t tile_cols = linear_tile_cols(n_tok);
  const bool one_tile = n_cols <= tile_cols;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    report->first_offset = row_offsets[0];
    report->last_offset = row_offsets[n_rows];
  }
  // Columns [tile0, tile0 + tile_cols) of every token, zeros past n_cols: unset bits meet them.
  const auto stage_tile = [&](int64_t tile0) {
    for (int t = 0; t < n_tok; ++t)
      for (int64_t c = threadIdx.x; c < tile_cols; c += blockDim.x)
        x_tile[t * tile_cols + c] = tile0 + c < n_cols ? x[t * n_cols + tile0 + c] : 0.f;
  };
  if (one_tile) {
    stage_tile(0);
    __syncthreads();
  }
  // Block-uniform loops (row groups, tiles): every thread reaches every barrier.
  for (int64_t base = int64_t(blockIdx.x) * warps_per_block; base < n_rows;
       base += int64_t(gridDim.x) * warps_per_block) {
    const int64_t r = base + threadIdx.x / 32;
    int64_t start = 0, length = 0;
    const int code =
        r < n_rows ? check_row_bounds(bitmap, row_offsets, r, n_rows, n_cols, nnz, start, length) : kEndorRowOk;
    bool active = r < n_rows && code == kEndorRowOk;
    if (r < n_rows && code != kEndorRowOk && lane == 0) report_row(report, r, code);
    const uint8_t* row_bitmap = bitmap + (active ? r : 0) * row_bytes;
    float acc[MAX_TOK] = {};
    int64_t used = 0;
    for (int64_t tile0 = 0; tile0 < n_cols; tile0 += tile_cols) {
      if (!one_tile) {
        __syncthreads();  // every warp is done with the previous tile
        stage_tile(tile0);
        __syncthreads();
      }
      if (!active) continue;
      const int64_t b_tile = tile0 / 8;
      const int64_t b_end = b_tile + tile_cols / 8 < row_bytes ? b_tile + tile_cols / 8 : row_bytes;
      used += walk_row(row_bitmap, b_tile, b_end, values + start + used, length - used, lane,
                       [&](int64_t b0, const Value(&e)[kEndorStepsPerIter][8]) {
#pragma unroll
                         for (int s = 0; s < kEndorStepsPerIter; ++s) {
                           float w[8];
#pragma unroll
                           for (int j = 0; j < 8; ++j) w[j] = ffn_detail::to_float<KIND>(e[s][j]);
                           const int64_t col = 8 * (b0 - b_tile + 32 * s + lane);  // in the tile
#pragma unroll
                           for (int t = 0; t < MAX_TOK; ++t) {
                             if (t < n_tok) {
                               const uint4 lo = x_tile_words[(t * tile_cols + col) / 4];
                               const uint4 hi = x_tile_words[(t * tile_cols + col) / 4 + 1];
                               acc[t] += w[0] * bits_to_float(lo.x) + w[1] * bits_to_float(lo.y) +
                                         w[2] * bits_to_float(lo.z) + w[3] * bits_to_float(lo.w) +
                                         w[4] * bits_to_float(hi.x) + w[5] * bits_to_float(hi.y) +
                                         w[6] * bits_to_float(hi.z) + w[7] * bits_to_float(hi.w);
                             }
                           }
                         }
                       });
    }
    if (active && used != length) {
      if (lane == 0) report_row(report, r, kEndorRowCountMismatch);
      active = false;
    }
    if (r >= n_rows) continue;
    // A refused row comes out as zeros: the CUDA glue reads the report back only when kernel checks are on.
    const float b = active && bias != nullptr ? bias[r] : 0.f;
#pragma unroll
    for (int t = 0; t < MAX_TOK; ++t) {
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
    const auto run = [&](auto kind_tag, auto max_tok) {
      constexpr int K = decltype(kind_tag)::value, M = decltype(max_tok)::value;
      return launch(endor_linear_kernel<K, M>, grid, block, x + t0 * n_cols, nt,
                    static_cast<const ffn_detail::Storage<K>*>(values), bitmap, row_offsets, n_rows, n_cols, nnz, bias,
                    y + t0 * n_rows, report);
    };
    const auto run_kind = [&](auto kind_tag) {
      return nt <= 1 ? run(kind_tag, std::integral_constant<int, 1>{})
                     : run(kind_tag, std::integral_constant<int, kLinearMaxTokens>{});
    };
    const cudaError_t status = kind == kFfnF32   ? run_kind(std::integral_constant<int, kFfnF32>{})
                               : kind == kFfnF16 ? run_kind(std::integral_constant<int, kFfnF16>{})
                                                 : run_kind(std::integral_constant<int, kFfnBF16>{});
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

}  // namespace flashllm
