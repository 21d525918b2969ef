// The CUDA build's instance of the quantized_linear launcher (quantized_linear_kernel.cuh).
#include "cuda/cuda_launch.cuh"
#include "cuda/kernels.cuh"
#include "cuda/quantized_linear_kernel.cuh"

namespace flashllm {

cudaError_t launch_quantized_linear(const float* x, int64_t n_tok, int64_t d, const uint8_t* w, int format,
                                    int64_t n_rows, const float* bias, int8_t* codes, float* scale, float* scaled_sum,
                                    float* y, cudaStream_t stream) {
  return launch_quantized_linear(CudaLaunch{stream}, x, n_tok, d, w, format, n_rows, bias, codes, scale, scaled_sum, y);
}

}  // namespace flashllm
