// The CUDA build's instance of the Endor decompression launcher (endor_decompress_kernel.cuh).
#include "cuda/cuda_launch.cuh"
#include "cuda/endor_decompress_kernel.cuh"
#include "cuda/kernels.cuh"

namespace flashllm {

cudaError_t launch_endor_decompress(const void* values, int elem_bytes, const uint8_t* bitmap,
                                    const int64_t* row_offsets, const int64_t* rows, int64_t n_rows, int64_t n_cols,
                                    int64_t nnz, int64_t n_out, void* out, EndorReport* report, cudaStream_t stream) {
  return launch_endor_decompress(CudaLaunch{stream}, values, elem_bytes, bitmap, row_offsets, rows, n_rows, n_cols, nnz,
                                 n_out, out, report);
}

}  // namespace flashllm
