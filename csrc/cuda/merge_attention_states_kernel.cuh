// The CUDA kernel of flashllm::merge_attention_states and its launcher: plain CUDA C++ over raw pointers. Included
// by merge_attention_states.cu and, through the CPU SIMT emulation (csrc/simt/simt.h), by flashllm_ext._simt, which
// runs the same launcher with the emulation's launch policy. Include cuda_runtime.h or simt/simt.h first.
//
// One warp per (b, h) row: every lane finds the row's max, total and lse over the P parts (P is small: a handful of
// shards, the buffer, the X-cache part), then the lanes split D. The rule is common/merge_attention_states_checks.h's.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/attention_grid.h"

namespace flashllm {

// outs [P, n_rows, D] and lses [P, n_rows] contiguous float32 -> out [n_rows, D], lse [n_rows].
__global__ void __launch_bounds__(kMergeWarps * 32)
    merge_attention_states_kernel(const float* __restrict__ outs, const float* __restrict__ lses, int64_t n_parts,
                                  int64_t n_rows, int64_t head_dim, float* __restrict__ out, float* __restrict__ lse) {
  const int64_t row = int64_t(blockIdx.x) * kMergeWarps + threadIdx.x / 32;
  if (row >= n_rows) return;
  const int lane = threadIdx.x % 32;
  float top = -INFINITY;
  bool nan = false;
  for (int64_t p = 0; p < n_parts; ++p) {
    const float x = lses[p * n_rows + row];
    nan = nan || x != x;
    top = fmaxf(top, x);
  }
  if (nan) top = NAN;
  if (top == -INFINITY) top = 0.f;  // every part empty: exp(-inf - 0) = 0, never exp(-inf - -inf)
  float total = 0.f;
  for (int64_t p = 0; p < n_parts; ++p) total += expf(lses[p * n_rows + row] - top);
  if (lane == 0) lse[row] = top + logf(total);
  const float inv = total == 0.f ? 0.f : 1.f / total;
  for (int64_t d = lane; d < head_dim; d += 32) {
    float o = 0.f;
    for (int64_t p = 0; p < n_parts; ++p) {
      const float w = expf(lses[p * n_rows + row] - top) * inv;
      if (w != 0.f) o += w * outs[(p * n_rows + row) * head_dim + d];  // an empty part's out is not read
    }
    out[row * head_dim + d] = o;
  }
}

// The merge of n_parts partial results over n_rows rows of head_dim, through `launch` (a launch policy: CudaLaunch,
// simt::EmulatedLaunch). Refuses (cudaErrorInvalidValue) a grid over the device's limits.
template <class Launch>
cudaError_t launch_merge_attention_states(const Launch& launch, const float* outs, const float* lses, int64_t n_parts,
                                          int64_t n_rows, int64_t head_dim, float* out, float* lse) {
  if (n_rows == 0) return cudaSuccess;
  const int64_t blocks = (n_rows + kMergeWarps - 1) / kMergeWarps;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  return launch(merge_attention_states_kernel, dim3(unsigned(blocks)), dim3(kMergeWarps * 32), outs, lses, n_parts,
                n_rows, head_dim, out, lse);
}

}  // namespace flashllm
