// The CUDA build's instance of the sparse FFN launcher (sparse_ffn_kernel.cuh).
#include "cuda/cuda_launch.cuh"
#include "cuda/kernels.cuh"
#include "cuda/sparse_ffn_kernel.cuh"

namespace flashllm {

cudaError_t launch_sparse_ffn(const float* x, int64_t n_tok, int64_t d, const void* matrix, int kind, const void* bias,
                              const int64_t* index, int64_t n_rows, int64_t num_used, int act, bool glu,
                              float threshold, float* act_buf, float* partial, float* y, cudaStream_t stream) {
  return launch_sparse_ffn(CudaLaunch{stream}, x, n_tok, d, matrix, kind, bias, index, n_rows, num_used, act, glu,
                           threshold, act_buf, partial, y);
}

}  // namespace flashllm
