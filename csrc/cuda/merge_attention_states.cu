// The CUDA build's instance of the attention-state merge launcher (merge_attention_states_kernel.cuh).
#include "cuda/cuda_launch.cuh"
#include "cuda/kernels.cuh"
#include "cuda/merge_attention_states_kernel.cuh"

namespace flashllm {

cudaError_t launch_merge_attention_states(const float* outs, const float* lses, int64_t n_parts, int64_t n_rows,
                                          int64_t head_dim, float* out, float* lse, cudaStream_t stream) {
  return launch_merge_attention_states(CudaLaunch{stream}, outs, lses, n_parts, n_rows, head_dim, out, lse);
}

}  // namespace flashllm
