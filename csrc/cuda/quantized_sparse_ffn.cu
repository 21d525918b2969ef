// The CUDA build's instance of the quantized sparse FFN launcher (quantized_sparse_ffn_kernel.cuh).
#include "cuda/cuda_launch.cuh"
#include "cuda/kernels.cuh"
#include "cuda/quantized_sparse_ffn_kernel.cuh"

namespace flashllm {

cudaError_t launch_quantized_sparse_ffn(const float* x, int64_t n_tok, int64_t d, const uint8_t* matrix,
                                        int64_t row_bytes, int in_format, int down_format, const float* bias,
                                        const int64_t* index, int64_t n_rows, int64_t num_used, int act, bool glu,
                                        float threshold, int8_t* codes, float* scale, float* scaled_sum, float* act_buf,
                                        float* partial, float* y, cudaStream_t stream) {
  return launch_quantized_sparse_ffn(CudaLaunch{stream}, x, n_tok, d, matrix, row_bytes, in_format, down_format, bias,
                                     index, n_rows, num_used, act, glu, threshold, codes, scale, scaled_sum, act_buf,
                                     partial, y);
}

}  // namespace flashllm
