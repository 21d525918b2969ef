// The CUDA kernels of flashllm::sparse_ffn and their launcher: plain CUDA C++ over raw pointers. Included by
// sparse_ffn.cu and, through the CPU SIMT emulation (csrc/simt/simt.h), by flashllm_ext._simt, which runs the same
// launcher with the emulation's launch policy. Include cuda_runtime.h or simt/simt.h first (dim3, cudaError_t).
//
// sparse_ffn (semantics in flashllm_ext/ops/) runs as three kernels for up to kFfnMaxTokens tokens:
//   1. ffn_act_kernel: one warp per row (rows across blocks, grid-stride). Lanes stride over the row's input
//      column(s) with 16-byte vector loads, T dot products per lane, warp reductions (__shfl_xor_sync); every lane
//      then holds the sums and lane 0 writes the activations act[T, n_rows] (float32, zero where thresholded).
//   2. ffn_down_kernel: blocks tile (column block, row chunk). A block stages the activations of 64 rows in shared
//      memory, then each thread owns kVec consecutive columns and accumulates act * down_row for its rows in
//      registers (vector loads again; rows whose activations are all zero are skipped). It writes its chunk's
//      partial sums partial[chunk, T, d]: no atomics.
//   3. ffn_reduce_kernel: y[T, d] = sum over chunks of partial (the one atomic-free final reduction, float32).
// Elements: KIND 0 float32, 1 float16, 2 bfloat16, stored as float / uint16_t bits; math in float32. Vector loads
// are used when the caller says rows are 16-byte aligned (matrix base and d * element size), scalar loads otherwise.
// The act and down kernels read rows through a Bundles policy (FloatBundles here; quantized_sparse_ffn's
// QuantizedBundles reads rows of GGUF blocks), so both ops share the kernels' tiling, activation and thresholds.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/ffn_grid.h"
#include "common/half_bits.h"

namespace flashllm {

namespace ffn_detail {

constexpr unsigned kFullMask = 0xffffffffu;

// Elements per 16-byte vector.
template <int KIND>
constexpr int kVec = 16 / int(sizeof(Storage<KIND>));

// Loads kVec elements at 16-byte aligned p as floats.
template <int KIND>
__device__ __forceinline__ void load_vec(const Storage<KIND>* p, float (&f)[kVec<KIND>]) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (KIND == kFfnF32) {
      f[i] = bits_to_float(w[i]);
    } else {
      f[2 * i] = to_float<KIND>(uint16_t(w[i] & 0xffffu));
      f[2 * i + 1] = to_float<KIND>(uint16_t(w[i] >> 16));
    }
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(kFullMask, v, s);
  return v;
}

__device__ __forceinline__ float activate(float v, int act) {
  if (act == 0) return v < 0.f ? 0.f : v;  // NaN stays NaN, as torch's relu
  if (act == 1) return v / (1.f + expf(-v));
  if (act == 2) return 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
  return 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));  // 3: tanh-approximated
}

// Adds w . x[t] over this lane's share of one column of d elements, for NT tokens (x: [NT, d] float32).
template <int KIND>
__device__ __forceinline__ void lane_dots(const Storage<KIND>* col, const float* __restrict__ x, int64_t d, int n_tok,
                                          bool vector, int lane, float (&acc)[kFfnMaxTokens]) {
  constexpr int V = kVec<KIND>;
  if (vector) {
    for (int64_t c = int64_t(lane) * V; c < d; c += 32 * V) {
      float w[V];
      load_vec<KIND>(col + c, w);
#pragma unroll
      for (int t = 0; t < kFfnMaxTokens; ++t) {
        if (t < n_tok) {
#pragma unroll
          for (int v = 0; v < V; ++v) acc[t] += w[v] * x[t * d + c + v];
        }
      }
    }
  } else {
    for (int64_t c = lane; c < d; c += 32) {
      const float w = to_float<KIND>(col[c]);
#pragma unroll
      for (int t = 0; t < kFfnMaxTokens; ++t)
        if (t < n_tok) acc[t] += w * x[t * d + c];
    }
  }
}

}  // namespace ffn_detail

// The bundles of a float matrix (KIND: FfnKind) as the act and down kernels read them: a row is up | gate (GLU) |
// down, d elements each. The quantized kernels' QuantizedBundles (quantized_sparse_ffn_kernel.cuh) reads blocks.
template <int KIND>
struct FloatBundles {
  static constexpr int kDownVec = ffn_detail::kVec<KIND>;  // down columns per thread of ffn_down_kernel
  const float* x;                                          // [n_tok, d] of this launch's tokens
  const ffn_detail::Storage<KIND>* matrix;
  const ffn_detail::Storage<KIND>* bias;  // may be null
  int64_t d;
  bool glu, vector;  // vector: rows 16-byte aligned (16-byte loads)

  // acc[t] += this lane's share of x[t] . (the activation's input column of row r: gate for GLU, else up).
  __device__ __forceinline__ void act_dots(int64_t r, int n_tok, int lane, float (&acc)[kFfnMaxTokens]) const {
    ffn_detail::lane_dots<KIND>(matrix + r * width() + (glu ? d : 0), x, d, n_tok, vector, lane, acc);
  }
  // acc[t] += this lane's share of x[t] . (row r's up column), GLU only.
  __device__ __forceinline__ void up_dots(int64_t r, int n_tok, int lane, float (&acc)[kFfnMaxTokens]) const {
    ffn_detail::lane_dots<KIND>(matrix + r * width(), x, d, n_tok, vector, lane, acc);
  }
  __device__ __forceinline__ float bias_of(int64_t r) const {
    return bias != nullptr ? ffn_detail::to_float<KIND>(bias[r]) : 0.f;
  }
  // Row r's down weights col0 .. col0 + kDownVec - 1 (col0 < d; zeros past d).
  __device__ __forceinline__ void down(int64_t r, int64_t col0, float (&w)[kDownVec]) const {
    const ffn_detail::Storage<KIND>* row = matrix + r * width() + (glu ? 2 : 1) * d;
    if (vector) {
      ffn_detail::load_vec<KIND>(row + col0, w);
    } else {
#pragma unroll
      for (int v = 0; v < kDownVec; ++v) w[v] = col0 + v < d ? ffn_detail::to_float<KIND>(row[col0 + v]) : 0.f;
    }
  }
  __device__ __forceinline__ int64_t width() const { return (glu ? 3 : 2) * d; }
};

// act[t * n_rows + o] for row o of the problem (rows[o] of the bundles when index is not null): h, the activation of
// the row's input column for token t (times x . up for GLU), zero where |h| <= threshold. The rows of index
// entries outside [0, num_used) are never read: the kernel writes 0 for them (the CUDA glue checks index on the host
// only when kernel checks are on, common/kernel_checks.h). Bundles: FloatBundles or QuantizedBundles.
template <class Bundles>
__global__ void __launch_bounds__(kFfnActWarps * 32)
    ffn_act_kernel(Bundles bundles, const int64_t* __restrict__ index, int64_t n_rows, int64_t num_used, int n_tok,
                   int act, bool glu, float threshold, float* __restrict__ act_out) {
  using namespace ffn_detail;
  const int lane = threadIdx.x % 32;
  for (int64_t o = int64_t(blockIdx.x) * kFfnActWarps + threadIdx.x / 32; o < n_rows;
       o += int64_t(gridDim.x) * kFfnActWarps) {
    const int64_t r = index != nullptr ? index[o] : o;
    float h[kFfnMaxTokens] = {}, up[kFfnMaxTokens] = {};
    if (r >= 0 && r < num_used) {  // the same in every lane: the warp stays converged
      bundles.act_dots(r, n_tok, lane, h);
      if (glu) bundles.up_dots(r, n_tok, lane, up);
      const float b = bundles.bias_of(r);
#pragma unroll
      for (int t = 0; t < kFfnMaxTokens; ++t) {
        const float a = activate(warp_sum(h[t]) + b, act);
        const float value = glu ? a * warp_sum(up[t]) : a;
        h[t] = fabsf(value) <= threshold ? 0.f : value;  // the active-neuron rule: |h| > threshold (NaN stays)
      }
    }
    if (lane == 0) {
#pragma unroll
      for (int t = 0; t < kFfnMaxTokens; ++t)
        if (t < n_tok) act_out[t * n_rows + o] = h[t];
    }
  }
}

// partial[chunk, t, c] = sum over the chunk's rows o of act[t, o] * down_row(o)[c]. Grid (col_blocks, chunks).
template <class Bundles>
__global__ void __launch_bounds__(kFfnDownThreads)
    ffn_down_kernel(Bundles bundles, const int64_t* __restrict__ index, const float* __restrict__ act_in,
                    int64_t n_rows, int64_t num_used, int64_t d, int n_tok, int64_t rows_per_chunk,
                    float* __restrict__ partial) {
  constexpr int V = Bundles::kDownVec;
  __shared__ float tile_act[kFfnMaxTokens][kFfnTileRows];
  __shared__ int64_t tile_row[kFfnTileRows];
  const int64_t col0 = (int64_t(blockIdx.x) * kFfnDownThreads + threadIdx.x) * V;
  const int64_t begin = int64_t(blockIdx.y) * rows_per_chunk;
  const int64_t end = begin + rows_per_chunk < n_rows ? begin + rows_per_chunk : n_rows;
  float acc[kFfnMaxTokens][V];
#pragma unroll
  for (int t = 0; t < kFfnMaxTokens; ++t)
#pragma unroll
    for (int v = 0; v < V; ++v) acc[t][v] = 0.f;
  for (int64_t base = begin; base < end; base += kFfnTileRows) {
    const int64_t n_tile = end - base < kFfnTileRows ? end - base : kFfnTileRows;
    __syncthreads();  // the previous tile is no longer read
    for (int64_t k = threadIdx.x; k < n_tile; k += kFfnDownThreads) {
      const int64_t r = index != nullptr ? index[base + k] : base + k;
      bool any = false;
      for (int t = 0; t < kFfnMaxTokens; ++t) {
        const float a = t < n_tok ? act_in[t * n_rows + base + k] : 0.f;
        tile_act[t][k] = a;
        any |= a != 0.f;
      }
      tile_row[k] = (any && r >= 0 && r < num_used) ? r : -1;  // -1: nothing to add
    }
    __syncthreads();
    for (int64_t k = 0; k < n_tile; ++k) {
      const int64_t r = tile_row[k];
      if (r < 0 || col0 >= d) continue;
      float w[V];
      bundles.down(r, col0, w);
#pragma unroll
      for (int t = 0; t < kFfnMaxTokens; ++t) {
        const float a = tile_act[t][k];
#pragma unroll
        for (int v = 0; v < V; ++v) acc[t][v] += a * w[v];
      }
    }
  }
  float* out = partial + int64_t(blockIdx.y) * n_tok * d;
#pragma unroll
  for (int t = 0; t < kFfnMaxTokens; ++t)  // unrolled with a guard: acc stays in registers
#pragma unroll
    for (int v = 0; v < V; ++v)
      if (t < n_tok && col0 + v < d) out[t * d + col0 + v] = acc[t][v];
}

// y[i] = sum over chunks of partial[chunk * n + i], n = T * d, float32. Static: sparse_ffn.cu and
// quantized_sparse_ffn.cu each have their own.
static __global__ void __launch_bounds__(kFfnReduceThreads)
    ffn_reduce_kernel(const float* __restrict__ partial, int64_t chunks, int64_t n, float* __restrict__ y) {
  for (int64_t i = int64_t(blockIdx.x) * kFfnReduceThreads + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * kFfnReduceThreads) {
    float s = 0.f;
    for (int64_t k = 0; k < chunks; ++k) s += partial[k * n + i];
    y[i] = s;
  }
}

// y [n_tok, d] float32 = flashllm::sparse_ffn of x [n_tok, d] float32 over n_rows rows of the bundle matrix, through
// `launch` (a launch policy: CudaLaunch, simt::EmulatedLaunch). KIND: FfnKind of matrix and bias. index may be null
// (rows [0, n_rows)); entries outside [0, num_used) contribute nothing (the kernels never read their rows). Scratch:
// act_buf [min(n_tok, 8) * n_rows] and partial [ffn_grid(...).chunks * min(n_tok, 8) * d] floats.
// One group of at most kFfnMaxTokens tokens through the three kernels: act_buf and partial as sized for the group,
// y the group's [nt, d] outputs. Bundles: this group's FloatBundles or QuantizedBundles.
template <class Bundles, class Launch>
cudaError_t launch_ffn_token_group(const Launch& launch, const Bundles& bundles, int nt, int64_t d,
                                   const int64_t* index, int64_t n_rows, int64_t num_used, int act, bool glu,
                                   float threshold, float* act_buf, float* partial, float* y) {
  const FfnGrid g = ffn_grid(n_rows, d, 16 / Bundles::kDownVec);
  cudaError_t err = launch(ffn_act_kernel<Bundles>, dim3(unsigned(g.act_blocks)), dim3(kFfnActWarps * 32), bundles,
                           index, n_rows, num_used, nt, act, glu, threshold, act_buf);
  if (err != cudaSuccess) return err;
  err = launch(ffn_down_kernel<Bundles>, dim3(unsigned(g.col_blocks), unsigned(g.chunks)), dim3(kFfnDownThreads),
               bundles, index, act_buf, n_rows, num_used, d, nt, g.rows_per_chunk, partial);
  if (err != cudaSuccess) return err;
  const int64_t n = nt * d;
  const int64_t blocks = (n + kFfnReduceThreads - 1) / kFfnReduceThreads;
  return launch(ffn_reduce_kernel, dim3(unsigned(blocks < kFfnMaxBlocks ? blocks : kFfnMaxBlocks)),
                dim3(kFfnReduceThreads), partial, g.chunks, n, y);
}

template <int KIND, class Launch>
cudaError_t launch_sparse_ffn_typed(const Launch& launch, const float* x, int64_t n_tok, int64_t d, const void* matrix,
                                    const void* bias, const int64_t* index, int64_t n_rows, int64_t num_used, int act,
                                    bool glu, float threshold, float* act_buf, float* partial, float* y) {
  using S = ffn_detail::Storage<KIND>;
  const bool vector = reinterpret_cast<uintptr_t>(matrix) % 16 == 0 && (d * int64_t(sizeof(S))) % 16 == 0;
  for (int64_t t0 = 0; t0 < n_tok; t0 += kFfnMaxTokens) {
    const int nt = int(n_tok - t0 < kFfnMaxTokens ? n_tok - t0 : kFfnMaxTokens);
    const FloatBundles<KIND> bundles{x + t0 * d, static_cast<const S*>(matrix), static_cast<const S*>(bias), d, glu,
                                     vector};
    const cudaError_t err = launch_ffn_token_group(launch, bundles, nt, d, index, n_rows, num_used, act, glu, threshold,
                                                   act_buf, partial, y + t0 * d);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// launch_sparse_ffn_typed for the element kind `kind` known at run time.
template <class Launch>
cudaError_t launch_sparse_ffn(const Launch& launch, const float* x, int64_t n_tok, int64_t d, const void* matrix,
                              int kind, const void* bias, const int64_t* index, int64_t n_rows, int64_t num_used,
                              int act, bool glu, float threshold, float* act_buf, float* partial, float* y) {
  switch (kind) {
    case kFfnF32:
      return launch_sparse_ffn_typed<kFfnF32>(launch, x, n_tok, d, matrix, bias, index, n_rows, num_used, act, glu,
                                              threshold, act_buf, partial, y);
    case kFfnF16:
      return launch_sparse_ffn_typed<kFfnF16>(launch, x, n_tok, d, matrix, bias, index, n_rows, num_used, act, glu,
                                              threshold, act_buf, partial, y);
    case kFfnBF16:
      return launch_sparse_ffn_typed<kFfnBF16>(launch, x, n_tok, d, matrix, bias, index, n_rows, num_used, act, glu,
                                               threshold, act_buf, partial, y);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace flashllm
