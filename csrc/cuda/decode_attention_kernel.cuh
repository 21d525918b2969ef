// The CUDA kernel of flashllm::decode_attention and its launcher: plain CUDA C++ over raw pointers. Included by
// decode_attention.cu and, through the CPU SIMT emulation (csrc/simt/simt.h), by flashllm_ext._simt, which runs the
// same launcher with the emulation's launch policy. Include cuda_runtime.h or simt/simt.h first (dim3, cudaError_t).
//
// One block per (sequence, kv head) and group of up to kAttentionHeads query heads of that kv head, so a GQA
// group's K/V rows are read once. The kAttentionWarps warps split the tokens into contiguous chunks; in a warp, lane
// l holds elements l, l + 32, ... of each row (coalesced loads), a dot product is a warp reduction, and each warp
// keeps its own online softmax (running max, sum and accumulator per head, in registers). The warps' states are then
// merged through shared memory by the log-sum-exp rule. Elements: KIND 0 float32, 1 float16, 2 bfloat16 (FfnKind),
// math in float32.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/attention_grid.h"
#include "common/ffn_grid.h"
#include "common/half_bits.h"

namespace flashllm {

namespace attention_detail {

using ffn_detail::Storage;
using ffn_detail::to_float;

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kPerLane = kAttentionMaxHeadDim / 32;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) v += __shfl_xor_sync(kFullMask, v, s);
  return v;
}

}  // namespace attention_detail

template <int KIND>
__global__ void __launch_bounds__(kAttentionWarps * 32)
    decode_attention_kernel(const float* __restrict__ q, const attention_detail::Storage<KIND>* __restrict__ k,
                            const attention_detail::Storage<KIND>* __restrict__ v, AttentionArgs a,
                            float* __restrict__ out, float* __restrict__ lse) {
  using namespace attention_detail;
  constexpr int H = kAttentionHeads;
  const int64_t b = blockIdx.x / a.n_kv_heads, g = blockIdx.x % a.n_kv_heads, group = a.n_q_heads / a.n_kv_heads;
  const int64_t first_head = b * a.n_q_heads + g * group + int64_t(blockIdx.y) * H;  // row of q, out and lse
  const int n_heads = int(group - int64_t(blockIdx.y) * H < H ? group - int64_t(blockIdx.y) * H : H);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t D = a.head_dim;

  float qr[H][kPerLane], acc[H][kPerLane], run_max[H], run_sum[H];
#pragma unroll
  for (int h = 0; h < H; ++h) {
    run_max[h] = -INFINITY;
    run_sum[h] = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int64_t d = lane + 32 * i;
      qr[h][i] = h < n_heads && d < D ? q[(first_head + h) * D + d] : 0.f;
      acc[h][i] = 0.f;
    }
  }
  const int64_t per_warp = (a.seq + kAttentionWarps - 1) / kAttentionWarps;
  const int64_t t_begin = warp * per_warp, t_end = t_begin + per_warp < a.seq ? t_begin + per_warp : a.seq;
  for (int64_t t = t_begin; t < t_end; ++t) {
    const Storage<KIND>* k_row = k + t * a.k_stride[0] + b * a.k_stride[1] + g * a.k_stride[2];
    const Storage<KIND>* v_row = v + t * a.v_stride[0] + b * a.v_stride[1] + g * a.v_stride[2];
    float x[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) x[i] = lane + 32 * i < D ? to_float<KIND>(k_row[lane + 32 * i]) : 0.f;
    float alpha[H], p[H];
#pragma unroll
    for (int h = 0; h < H; ++h) {
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) s += qr[h][i] * x[i];
      s = warp_sum(s);  // every lane of the warp runs this: n_heads and the token range are warp-uniform
      const float new_max = fmaxf(run_max[h], s);
      alpha[h] = expf(run_max[h] - new_max);  // 0 at the first token (run_max = -inf)
      p[h] = expf(s - new_max);
      run_sum[h] = run_sum[h] * alpha[h] + p[h];
      run_max[h] = new_max;
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) x[i] = lane + 32 * i < D ? to_float<KIND>(v_row[lane + 32 * i]) : 0.f;
#pragma unroll
    for (int h = 0; h < H; ++h)
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) acc[h][i] = acc[h][i] * alpha[h] + p[h] * x[i];
  }

  // Merge the warps' states: out = sum_w exp(m_w - top) acc_w / sum_w exp(m_w - top) l_w, lse = top + log(total).
  __shared__ float shared_max[kAttentionWarps][H], shared_sum[kAttentionWarps][H];
  __shared__ float shared_acc[kAttentionWarps][H][kAttentionMaxHeadDim];
#pragma unroll
  for (int h = 0; h < H; ++h) {
    if (lane == 0) shared_max[warp][h] = run_max[h], shared_sum[warp][h] = run_sum[h];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) shared_acc[warp][h][lane + 32 * i] = acc[h][i];
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < n_heads * D; e += blockDim.x) {
    const int h = int(e / D);
    const int64_t d = e % D;
    float top = -INFINITY;
    for (int w = 0; w < kAttentionWarps; ++w) top = fmaxf(top, shared_max[w][h]);
    if (top == -INFINITY) top = 0.f;  // no tokens at all: every weight below is exp(-inf) = 0, never NaN
    float total = 0.f, o = 0.f;
    for (int w = 0; w < kAttentionWarps; ++w) {
      const float weight = expf(shared_max[w][h] - top);
      total += weight * shared_sum[w][h];
      o += weight * shared_acc[w][h][d];
    }
    out[(first_head + h) * D + d] = total == 0.f ? 0.f : o / total;
    if (d == 0) lse[first_head + h] = top + logf(total);  // S = 0: 0 + log 0 = -inf
  }
}

// decode_attention over q (float32, pre-scaled), k and v (elements of `kind`, FfnKind) into out [B, Hq, D] and
// lse [B, Hq] (float32, every element written), through `launch` (a launch policy: CudaLaunch, simt::EmulatedLaunch).
// Refuses (cudaErrorInvalidValue) head_dim outside [1, kAttentionMaxHeadDim], a grid over the device's limits or
// an unknown kind.
template <class Launch>
cudaError_t launch_decode_attention(const Launch& launch, const float* q, const void* k, const void* v, int kind,
                                    const AttentionArgs& a, float* out, float* lse) {
  if (a.batch == 0) return cudaSuccess;
  if (a.head_dim < 1 || a.head_dim > kAttentionMaxHeadDim || a.n_kv_heads < 1 || a.n_q_heads % a.n_kv_heads != 0)
    return cudaErrorInvalidValue;
  const int64_t items = a.batch * a.n_kv_heads;
  const int64_t head_blocks = (a.n_q_heads / a.n_kv_heads + kAttentionHeads - 1) / kAttentionHeads;
  if (items > 0x7fffffff || head_blocks > 65535) return cudaErrorInvalidValue;
  const dim3 grid{unsigned(items), unsigned(head_blocks)}, block{kAttentionWarps * 32};
  using attention_detail::Storage;
  switch (kind) {
    case kFfnF32:
      return launch(decode_attention_kernel<kFfnF32>, grid, block, q, static_cast<const Storage<kFfnF32>*>(k),
                    static_cast<const Storage<kFfnF32>*>(v), a, out, lse);
    case kFfnF16:
      return launch(decode_attention_kernel<kFfnF16>, grid, block, q, static_cast<const Storage<kFfnF16>*>(k),
                    static_cast<const Storage<kFfnF16>*>(v), a, out, lse);
    case kFfnBF16:
      return launch(decode_attention_kernel<kFfnBF16>, grid, block, q, static_cast<const Storage<kFfnBF16>*>(k),
                    static_cast<const Storage<kFfnBF16>*>(v), a, out, lse);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace flashllm
