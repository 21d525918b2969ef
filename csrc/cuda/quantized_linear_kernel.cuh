// The CUDA kernel of flashllm::quantized_linear and its launcher: y = x W^T (+ bias) for weight rows of GGUF blocks
// (Q8_0, Q4_0, Q4_1: common/block_formats.h), x quantized per block of 32 columns first, so a row's dot product is
// integer sums per block, as the CPU kernel computes it. Plain CUDA C++ over raw pointers. Included by
// quantized_linear.cu and, through the CPU SIMT emulation (csrc/simt/simt.h), by flashllm_ext._simt, which runs the
// same launcher with the emulation's launch policy. Include cuda_runtime.h or simt/simt.h first (dim3, cudaError_t).
//
// Design: decode is bound by reading W once, so each row gets one warp (kQLinearWarps rows per block, grid-stride
// over row groups), each lane whole blocks (quantized_blocks.cuh: lane_block_dots), up to kQLinearMaxTokens tokens
// per launch; warp sums finish the row. Any bytes are a valid block, so nothing is refused and there is no report.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/block_formats.h"
#include "cuda/endor_warp.cuh"
#include "cuda/quantized_blocks.cuh"

namespace flashllm {

constexpr int kQLinearMaxTokens = 8;
constexpr int kQLinearWarps = 8;  // rows per block

// y[t * n_rows + r] = the dot product of row r of w [n_rows][n_blocks * kBlockBytes<FMT>] with token t's quantized x
// (+ bias[r]) for t < n_tok <= MAX_TOK. Launch with kQLinearWarps * 32 threads and
// quantized_grid_blocks(n_rows, kQLinearWarps) blocks.
template <int FMT, int MAX_TOK>
__global__ void __launch_bounds__(kQLinearWarps * 32)
    quantized_linear_kernel(const uint8_t* __restrict__ w, int64_t n_rows, int64_t n_blocks,
                            const int8_t* __restrict__ codes, const float* __restrict__ scale,
                            const float* __restrict__ scaled_sum, int n_tok, const float* __restrict__ bias,
                            float* __restrict__ y) {
  const int lane = threadIdx.x % 32;
  const int64_t row_bytes = n_blocks * kBlockBytes<FMT>;
  for (int64_t r = int64_t(blockIdx.x) * kQLinearWarps + threadIdx.x / 32; r < n_rows;
       r += int64_t(gridDim.x) * kQLinearWarps) {
    float acc[MAX_TOK] = {};
    quantized_detail::lane_block_dots<FMT, MAX_TOK>(w + r * row_bytes, n_blocks, codes, scale, scaled_sum, n_tok, lane,
                                                    acc);
    const float bias_r = bias != nullptr ? bias[r] : 0.f;
#pragma unroll
    for (int t = 0; t < MAX_TOK; ++t) {
      const float sum = endor_detail::warp_sum(acc[t]);
      if (lane == 0 && t < n_tok) y[t * n_rows + r] = sum + bias_r;
    }
  }
}

// y [n_tok, n_rows] = x [n_tok, d] W^T (+ bias) through `launch` (a launch policy: CudaLaunch, simt::EmulatedLaunch):
// x quantized once, then launches of at most kQLinearMaxTokens tokens. x, bias and y are float32 and contiguous, w
// uint8 [n_rows, ceil(d / 32) * block bytes] in `format` (BlockFormatCode); bias may be null. codes, scale and
// scaled_sum are device scratch of n_tok * ceil(d / 32) * 32 bytes and n_tok * ceil(d / 32) floats each, codes
// 32-byte aligned.
template <class Launch>
cudaError_t launch_quantized_linear(const Launch& launch, const float* x, int64_t n_tok, int64_t d, const uint8_t* w,
                                    int format, int64_t n_rows, const float* bias, int8_t* codes, float* scale,
                                    float* scaled_sum, float* y) {
  if (!is_block_format(format)) return cudaErrorInvalidValue;
  if (n_tok == 0 || n_rows == 0) return cudaSuccess;
  const cudaError_t quantized = launch_quantize_x(launch, x, n_tok, d, codes, scale, scaled_sum);
  if (quantized != cudaSuccess) return quantized;
  const int64_t n_blocks = (d + kBlock - 1) / kBlock;
  const dim3 grid(static_cast<unsigned>(quantized_grid_blocks(n_rows, kQLinearWarps))), block(kQLinearWarps * 32);
  for (int64_t t0 = 0; t0 < n_tok; t0 += kQLinearMaxTokens) {
    const int nt = static_cast<int>(n_tok - t0 < kQLinearMaxTokens ? n_tok - t0 : kQLinearMaxTokens);
    const int64_t k0 = t0 * n_blocks;
    const auto run = [&](auto fmt, auto max_tok) {
      constexpr int F = decltype(fmt)::value, M = decltype(max_tok)::value;
      return launch(quantized_linear_kernel<F, M>, grid, block, w, n_rows, n_blocks, codes + k0 * kBlock, scale + k0,
                    scaled_sum + k0, nt, bias, y + t0 * n_rows);
    };
    const cudaError_t status = with_block_format(format, [&](auto fmt) {
      return nt <= 1 ? run(fmt, std::integral_constant<int, 1>{})
                     : run(fmt, std::integral_constant<int, kQLinearMaxTokens>{});
    });
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

}  // namespace flashllm
