// What the CUDA kernels over rows of GGUF blocks share (quantized_linear_kernel.cuh, quantized_sparse_ffn_kernel.cuh):
// x quantized per block of 32 columns (quantize_x_kernel), a row's dot products with it (lane_block_dots), a block's
// weights as floats (block_values). Plain CUDA C++; include cuda_runtime.h or simt/simt.h first.
//
// quantize_x_kernel rounds every token's x once per call, one warp per (token, block), lane j column j, into int8
// codes, a float32 scale s and s * (sum of the codes) per block (flashllm_ext/ops/blocks.py quantize_x_blocks: s =
// max |x| / 127, code = round-half-away(x / s); a block holding inf or NaN gets a NaN scale). A row's dot product
// with a token is then, per block, d * s * (integer sum of code products) + c * s * (sum of x's codes), c the term of
// w = d * code + c (-8d for Q4_0's nibbles, Q4_1's m); lanes take whole blocks (lane, lane + 32, ...), read as 16-bit
// words (every block size is even). On sm_61+ the integer sums are __dp4a over 4 codes at a time; the emulation runs
// the same sums as a loop.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/block_formats.h"
#include "common/half_bits.h"
#include "cuda/endor_warp.cuh"

namespace flashllm {

constexpr int kQuantizeXWarps = 8;  // (token, block) pairs per block of quantize_x_kernel
constexpr int64_t kQuantizedMaxGrid = int64_t(1) << 16;

// Blocks of `warps` warps for `items` warps' work, at least one; past kQuantizedMaxGrid the warps loop.
inline int64_t quantized_grid_blocks(int64_t items, int warps) {
  const int64_t blocks = (items + warps - 1) / warps;
  return blocks < 1 ? 1 : blocks < kQuantizedMaxGrid ? blocks : kQuantizedMaxGrid;
}

namespace quantized_detail {

using endor_detail::kFullMask;

// Four int8 codes packed in a word, dotted with four others, added to acc.
__device__ __forceinline__ int dot4(int a, int b, int acc) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 610
  return __dp4a(a, b, acc);
#else
  for (int i = 0; i < 4; ++i) acc += int(int8_t(a >> (8 * i))) * int(int8_t(b >> (8 * i)));
  return acc;
#endif
}

__device__ __forceinline__ uint16_t u16_at(const uint8_t* p) {
  return *reinterpret_cast<const uint16_t*>(p);
}

__device__ __forceinline__ int word_at(const uint8_t* p) {
  return int(u16_at(p)) | int(u16_at(p + 2)) << 16;
}

// A block's scale d and the term c of w = d * code + c (Q4_0: -8d, Q4_1: m, Q8_0: 0).
template <int FMT>
__device__ __forceinline__ void block_scale(const uint8_t* blk, float& d, float& c) {
  d = ffn_detail::half_to_float(u16_at(blk));
  c = FMT == kQ4_1 ? ffn_detail::half_to_float(u16_at(blk + 2)) : FMT == kQ4_0 ? -8.f * d : 0.f;
}

template <int FMT>
__device__ __forceinline__ const uint8_t* block_code_bytes(const uint8_t* blk) {
  return blk + (FMT == kQ4_1 ? 4 : 2);
}

// A block's 32 codes, 4 int8 to a word in column order (Q8_0: q; 4-bit: the nibble n, 0..15; byte j of a 4-bit block
// holds weight j in its low nibble and j + 16 in its high one).
template <int FMT>
__device__ __forceinline__ void block_codes(const uint8_t* blk, int (&w)[8]) {
  const uint8_t* codes = block_code_bytes<FMT>(blk);
  if constexpr (FMT == kQ8_0) {
#pragma unroll
    for (int k = 0; k < 8; ++k) w[k] = word_at(codes + 4 * k);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int packed = word_at(codes + 4 * k);
      w[k] = packed & 0x0F0F0F0F;
      w[k + 4] = (packed >> 4) & 0x0F0F0F0F;
    }
  }
}

// Weights 8q .. 8q + 7 (q < 4) of a block as floats d * code + c.
template <int FMT>
__device__ __forceinline__ void block_values(const uint8_t* blk, int q, float (&w)[8]) {
  float d, c;
  block_scale<FMT>(blk, d, c);
  const uint8_t* codes = block_code_bytes<FMT>(blk);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    int word;
    if constexpr (FMT == kQ8_0) {
      word = word_at(codes + 8 * q + 4 * k);
    } else {
      word = (word_at(codes + 8 * (q % 2) + 4 * k) >> (q < 2 ? 0 : 4)) & 0x0F0F0F0F;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int code = FMT == kQ8_0 ? int(int8_t(word >> (8 * i))) : (word >> (8 * i)) & 0xFF;
      w[4 * k + i] = d * static_cast<float>(code) + c;
    }
  }
}

// Adds this lane's blocks' share of the dot products of a row of n_blocks blocks at `row` with MAX_TOK tokens
// (n_tok of them real) of quantized x to acc.
template <int FMT, int MAX_TOK>
__device__ __forceinline__ void lane_block_dots(const uint8_t* row, int64_t n_blocks, const int8_t* __restrict__ codes,
                                                const float* __restrict__ scale, const float* __restrict__ scaled_sum,
                                                int n_tok, int lane, float (&acc)[MAX_TOK]) {
  for (int64_t b = lane; b < n_blocks; b += 32) {
    const uint8_t* blk = row + b * kBlockBytes<FMT>;
    int wq[8];
    float d, c;
    block_codes<FMT>(blk, wq);
    block_scale<FMT>(blk, d, c);
#pragma unroll
    for (int t = 0; t < MAX_TOK; ++t) {
      if (t < n_tok) {
        const int64_t k = t * n_blocks + b;
        const int* xq = reinterpret_cast<const int*>(codes + k * kBlock);  // 32-byte aligned
        int isum = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) isum = dot4(wq[j], xq[j], isum);
        acc[t] += d * (scale[k] * static_cast<float>(isum)) + c * scaled_sum[k];
      }
    }
  }
}

}  // namespace quantized_detail

// codes [n_tok][n_blocks * 32] int8, scale and scaled_sum [n_tok][n_blocks] float32 from x [n_tok][d] float32. Static:
// each translation unit that launches it (quantized_linear.cu, quantized_sparse_ffn.cu) has its own.
// Launch with kQuantizeXWarps * 32 threads and quantized_grid_blocks(n_tok * n_blocks, kQuantizeXWarps) blocks.
static __global__ void __launch_bounds__(kQuantizeXWarps * 32)
    quantize_x_kernel(const float* __restrict__ x, int64_t n_tok, int64_t d, int64_t n_blocks,
                      int8_t* __restrict__ codes, float* __restrict__ scale, float* __restrict__ scaled_sum) {
  using quantized_detail::kFullMask;
  const int lane = threadIdx.x % 32;
  const int64_t items = n_tok * n_blocks;
  for (int64_t k = int64_t(blockIdx.x) * kQuantizeXWarps + threadIdx.x / 32; k < items;
       k += int64_t(gridDim.x) * kQuantizeXWarps) {
    const int64_t t = k / n_blocks, col = (k % n_blocks) * kBlock + lane;
    const float v = col < d ? x[t * d + col] : 0.f;
    const bool finite = __ballot_sync(kFullMask, v - v == 0.f) == kFullMask;  // inf - inf and NaN - NaN are NaN
    float amax = fabsf(v);
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, s));
    const float s = finite ? amax / 127.f : NAN, inv = s == 0.f || !finite ? 0.f : 1.f / s;
    const int code = finite ? int(roundf(v * inv)) : 0;
    codes[k * kBlock + lane] = static_cast<int8_t>(code);
    const int sum = endor_detail::warp_sum(code);
    if (lane == 0) {
      scale[k] = s;
      scaled_sum[k] = s * static_cast<float>(sum);
    }
  }
}

// quantize_x_kernel over every token through `launch`; codes 32-byte aligned.
template <class Launch>
cudaError_t launch_quantize_x(const Launch& launch, const float* x, int64_t n_tok, int64_t d, int8_t* codes,
                              float* scale, float* scaled_sum) {
  const int64_t n_blocks = (d + kBlock - 1) / kBlock;
  return launch(quantize_x_kernel,
                dim3(static_cast<unsigned>(quantized_grid_blocks(n_tok * n_blocks, kQuantizeXWarps))),
                dim3(kQuantizeXWarps * 32), x, n_tok, d, n_blocks, codes, scale, scaled_sum);
}

}  // namespace flashllm
