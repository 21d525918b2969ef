// The CUDA build's instance of the endor_linear launcher (endor_linear_kernel.cuh).
#include "cuda/cuda_launch.cuh"
#include "cuda/endor_linear_kernel.cuh"
#include "cuda/kernels.cuh"

namespace flashllm {

cudaError_t launch_endor_linear(const float* x, int64_t n_tok, const void* values, int kind, const uint8_t* bitmap,
                                const int64_t* row_offsets, int64_t n_rows, int64_t n_cols, int64_t nnz,
                                const float* bias, float* y, EndorReport* report, cudaStream_t stream) {
  return launch_endor_linear(CudaLaunch{stream}, x, n_tok, values, kind, bitmap, row_offsets, n_rows, n_cols, nnz, bias,
                             y, report);
}

}  // namespace flashllm
