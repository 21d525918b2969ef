// The CUDA launcher of flashllm::quantized_sparse_ffn: sparse_ffn's three kernels (sparse_ffn_kernel.cuh) over bundle
// rows of GGUF blocks (flashllm_ext/ops/blocks.py BundleFormat: up | gate (GLU) | down, each ceil(d / 32) blocks, the
// input columns in IN, the down row in DOWN), x quantized per block first (quantized_blocks.cuh), so the input
// columns' dot products are integer sums per block as on the CPU; the down rows are dequantized to float32, 8 columns
// a thread. Plain CUDA C++. Included by quantized_sparse_ffn.cu and, through the CPU SIMT emulation, by
// flashllm_ext._simt. Include cuda_runtime.h or simt/simt.h first.
#pragma once

#include <cstdint>
#include <type_traits>

#include "common/block_formats.h"
#include "common/ffn_grid.h"
#include "cuda/quantized_blocks.cuh"
#include "cuda/sparse_ffn_kernel.cuh"

namespace flashllm {

// The bundles of a quantized matrix as ffn_act_kernel and ffn_down_kernel read them (FloatBundles' interface).
template <int IN, int DOWN>
struct QuantizedBundles {
  static constexpr int kDownVec = 16 / kQuantizedDownElemBytes;  // down columns per thread: a quarter block
  const uint8_t* matrix;
  const float* bias;    // float32, may be null
  const int8_t* codes;  // this launch's tokens' quantized x (quantize_x_kernel)
  const float* scale;
  const float* scaled_sum;
  int64_t n_blocks, row_bytes;
  bool glu;

  __device__ __forceinline__ int64_t col_bytes() const { return n_blocks * kBlockBytes<IN>; }
  __device__ __forceinline__ void act_dots(int64_t r, int n_tok, int lane, float (&acc)[kFfnMaxTokens]) const {
    quantized_detail::lane_block_dots<IN, kFfnMaxTokens>(matrix + r * row_bytes + (glu ? col_bytes() : 0), n_blocks,
                                                         codes, scale, scaled_sum, n_tok, lane, acc);
  }
  __device__ __forceinline__ void up_dots(int64_t r, int n_tok, int lane, float (&acc)[kFfnMaxTokens]) const {
    quantized_detail::lane_block_dots<IN, kFfnMaxTokens>(matrix + r * row_bytes, n_blocks, codes, scale, scaled_sum,
                                                         n_tok, lane, acc);
  }
  __device__ __forceinline__ float bias_of(int64_t r) const { return bias != nullptr ? bias[r] : 0.f; }
  // Row r's down weights col0 .. col0 + 7 (col0 a multiple of 8 below d; past d the block's padding, never written).
  __device__ __forceinline__ void down(int64_t r, int64_t col0, float (&w)[kDownVec]) const {
    const uint8_t* blk = matrix + r * row_bytes + (glu ? 2 : 1) * col_bytes() + (col0 / kBlock) * kBlockBytes<DOWN>;
    quantized_detail::block_values<DOWN>(blk, int(col0 % kBlock) / kDownVec, w);
  }
};

// y [n_tok, d] float32 = flashllm::quantized_sparse_ffn of x [n_tok, d] float32 over n_rows rows of the bundle
// matrix (row_bytes each; in_format / down_format: BlockFormatCode), through `launch` (CudaLaunch,
// simt::EmulatedLaunch). bias: float32 [capacity] or null; index as sparse_ffn's. Scratch: codes, scale, scaled_sum as
// launch_quantize_x takes them, act_buf [min(n_tok, 8) * n_rows] and partial
// [ffn_grid(n_rows, d, kQuantizedDownElemBytes).chunks * min(n_tok, 8) * d] floats.
template <class Launch>
cudaError_t launch_quantized_sparse_ffn(const Launch& launch, const float* x, int64_t n_tok, int64_t d,
                                        const uint8_t* matrix, int64_t row_bytes, int in_format, int down_format,
                                        const float* bias, const int64_t* index, int64_t n_rows, int64_t num_used,
                                        int act, bool glu, float threshold, int8_t* codes, float* scale,
                                        float* scaled_sum, float* act_buf, float* partial, float* y) {
  if (!is_block_format(in_format) || !is_block_format(down_format)) return cudaErrorInvalidValue;
  if (n_tok == 0 || n_rows == 0 || d == 0) return cudaSuccess;
  const cudaError_t quantized = launch_quantize_x(launch, x, n_tok, d, codes, scale, scaled_sum);
  if (quantized != cudaSuccess) return quantized;
  const int64_t n_blocks = (d + kBlock - 1) / kBlock;
  return with_block_format(in_format, [&](auto in) {
    return with_block_format(down_format, [&](auto down) {
      constexpr int IN = decltype(in)::value, DOWN = decltype(down)::value;
      for (int64_t t0 = 0; t0 < n_tok; t0 += kFfnMaxTokens) {
        const int nt = int(n_tok - t0 < kFfnMaxTokens ? n_tok - t0 : kFfnMaxTokens);
        const int64_t k0 = t0 * n_blocks;
        const QuantizedBundles<IN, DOWN> bundles{matrix,          bias,     codes + k0 * kBlock, scale + k0,
                                                 scaled_sum + k0, n_blocks, row_bytes,           glu};
        const cudaError_t err = launch_ffn_token_group(launch, bundles, nt, d, index, n_rows, num_used, act, glu,
                                                       threshold, act_buf, partial, y + t0 * d);
        if (err != cudaSuccess) return err;
      }
      return cudaSuccess;
    });
  });
}

}  // namespace flashllm
