// The CUDA kernels of flashllm::cache_compact (the moves of csrc/common/compaction.h) and their launcher: plain CUDA
// C++ over raw pointers. Included by cache_compact.cu and, through the CPU SIMT emulation (csrc/simt/simt.h), by
// flashllm_ext._simt, which runs the same launcher with the emulation's launch policy. Include cuda_runtime.h or
// simt/simt.h first (dim3, cudaError_t).
//
// The CUDA glue checks the deleted rows on the host only when kernel checks are on (common/kernel_checks.h): on
// unchecked input (a row outside [0, num_used) or twice, a neuron id outside slot_of) every access below stays in
// bounds, the offending entries are skipped, and the cache state that results is unspecified.
#pragma once

#include <cstdint>

#include "common/compaction.h"

namespace flashllm {

constexpr int kCompactThreads = 128;

// Clears slot_of for the neurons of the deleted rows (before any row moves: pointer entries are read here).
__global__ void compact_forget_kernel(const int64_t* __restrict__ sorted, int64_t c, int64_t num_used,
                                      const int64_t* __restrict__ pointer, int64_t* __restrict__ slot_of,
                                      int64_t n_slots) {
  for (int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; k < c; k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = sorted[k];
    if (row < 0 || row >= num_used) continue;
    const int64_t neuron = pointer[row];
    if (neuron >= 0 && neuron < n_slots) slot_of[neuron] = -1;
  }
}

// Block j - n_new moves survivor row j into its hole (row_bytes per row, 16-byte copies when `vector`); every row
// past the new end gets pointer -1. Holes lie below n_new and sources at or past it, so blocks never collide.
// Launch with n_new >= 0 (c <= num_used).
__global__ void __launch_bounds__(kCompactThreads)
    compact_move_kernel(uint8_t* __restrict__ matrix, int64_t row_bytes, bool vector, int64_t* __restrict__ pointer,
                        uint8_t* __restrict__ bias, int bias_bytes, int64_t* __restrict__ slot_of, int64_t n_slots,
                        const int64_t* __restrict__ sorted, int64_t c, int64_t n_new) {
  const int64_t j = n_new + blockIdx.x;
  // Each block finds how many deleted rows lie below the new end itself (log c steps), so the host needs no copy.
  const int64_t holes = lower_bound_i64(sorted, c, n_new);
  const int64_t hole = compaction_hole(sorted, c, holes, n_new, j);
  if (hole >= 0) {
    uint8_t* dst = matrix + hole * row_bytes;
    const uint8_t* src = matrix + j * row_bytes;
    if (vector) {
      for (int64_t b = int64_t(threadIdx.x) * 16; b < row_bytes; b += kCompactThreads * 16)
        *reinterpret_cast<uint4*>(dst + b) = *reinterpret_cast<const uint4*>(src + b);
    } else {
      for (int64_t b = threadIdx.x; b < row_bytes; b += kCompactThreads) dst[b] = src[b];
    }
  }
  if (threadIdx.x == 0) {
    const int64_t neuron = pointer[j];
    pointer[j] = -1;
    if (hole >= 0) {
      pointer[hole] = neuron;
      if (slot_of != nullptr && neuron >= 0 && neuron < n_slots) slot_of[neuron] = hole;
      for (int b = 0; b < bias_bytes; ++b) bias[hole * bias_bytes + b] = bias[j * bias_bytes + b];
    }
  }
}

// Swap-delete of the c rows sorted_rows (ascending; distinct and < num_used unless unchecked, see above) in place,
// through `launch` (a launch policy: CudaLaunch, simt::EmulatedLaunch): matrix rows of row_bytes, pointer, bias
// entries of bias_bytes (bias may be null), slot_of of n_slots entries (may be null).
template <class Launch>
cudaError_t launch_cache_compact(const Launch& launch, uint8_t* matrix, int64_t row_bytes, int64_t* pointer,
                                 uint8_t* bias, int bias_bytes, int64_t* slot_of, int64_t n_slots,
                                 const int64_t* sorted_rows, int64_t c, int64_t num_used) {
  if (c == 0) return cudaSuccess;
  if (slot_of != nullptr) {
    const cudaError_t err = launch(compact_forget_kernel, dim3(unsigned((c + kCompactThreads - 1) / kCompactThreads)),
                                   dim3(kCompactThreads), sorted_rows, c, num_used, pointer, slot_of, n_slots);
    if (err != cudaSuccess) return err;
  }
  const bool vector = reinterpret_cast<uintptr_t>(matrix) % 16 == 0 && row_bytes % 16 == 0;
  return launch(compact_move_kernel, dim3(unsigned(c)), dim3(kCompactThreads), matrix, row_bytes, vector, pointer, bias,
                bias_bytes, slot_of, n_slots, sorted_rows, c, num_used - c);
}

}  // namespace flashllm
