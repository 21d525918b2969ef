// The CUDA build's instance of the cache compaction launcher (cache_compact_kernel.cuh).
#include "cuda/cache_compact_kernel.cuh"
#include "cuda/cuda_launch.cuh"
#include "cuda/kernels.cuh"

namespace flashllm {

cudaError_t launch_cache_compact(uint8_t* matrix, int64_t row_bytes, int64_t* pointer, uint8_t* bias, int bias_bytes,
                                 int64_t* slot_of, int64_t n_slots, const int64_t* sorted_rows, int64_t c,
                                 int64_t num_used, cudaStream_t stream) {
  return launch_cache_compact(CudaLaunch{stream}, matrix, row_bytes, pointer, bias, bias_bytes, slot_of, n_slots,
                              sorted_rows, c, num_used);
}

}  // namespace flashllm
