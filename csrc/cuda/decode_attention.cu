// The CUDA build's instance of the decode attention launcher (decode_attention_kernel.cuh).
#include "cuda/cuda_launch.cuh"
#include "cuda/decode_attention_kernel.cuh"
#include "cuda/kernels.cuh"

namespace flashllm {

cudaError_t launch_decode_attention(const float* q, const void* k, const void* v, int kind, const AttentionArgs& args,
                                    float* out, float* lse, cudaStream_t stream) {
  return launch_decode_attention(CudaLaunch{stream}, q, k, v, kind, args, out, lse);
}

}  // namespace flashllm
