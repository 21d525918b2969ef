// The CUDA build's launchers, for the torch glue (ops_cuda.cpp, compiled without nvcc): raw pointers and sizes in,
// cudaError_t out, kernels on `stream`. Each is the launch_* template of its <op>_kernel.cuh instantiated with
// CudaLaunch (cuda_launch.cuh), so what the SIMT tests run through the emulation is this launch code; the templates
// document the arguments. No torch headers here.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/attention_grid.h"
#include "common/endor_codes.h"

namespace flashllm {

cudaError_t launch_endor_decompress(const void* values, int elem_bytes, const uint8_t* bitmap,
                                    const int64_t* row_offsets, const int64_t* rows, int64_t n_rows, int64_t n_cols,
                                    int64_t nnz, int64_t n_out, void* out, EndorReport* report, cudaStream_t stream);

cudaError_t launch_endor_linear(const float* x, int64_t n_tok, const void* values, int kind, const uint8_t* bitmap,
                                const int64_t* row_offsets, int64_t n_rows, int64_t n_cols, int64_t nnz,
                                const float* bias, float* y, EndorReport* report, cudaStream_t stream);

cudaError_t launch_sparse_ffn(const float* x, int64_t n_tok, int64_t d, const void* matrix, int kind, const void* bias,
                              const int64_t* index, int64_t n_rows, int64_t num_used, int act, bool glu,
                              float threshold, float* act_buf, float* partial, float* y, cudaStream_t stream);

cudaError_t launch_quantized_sparse_ffn(const float* x, int64_t n_tok, int64_t d, const uint8_t* matrix,
                                        int64_t row_bytes, int in_format, int down_format, const float* bias,
                                        const int64_t* index, int64_t n_rows, int64_t num_used, int act, bool glu,
                                        float threshold, int8_t* codes, float* scale, float* scaled_sum, float* act_buf,
                                        float* partial, float* y, cudaStream_t stream);

cudaError_t launch_quantized_linear(const float* x, int64_t n_tok, int64_t d, const uint8_t* w, int format,
                                    int64_t n_rows, const float* bias, int8_t* codes, float* scale, float* scaled_sum,
                                    float* y, cudaStream_t stream);

cudaError_t launch_cache_compact(uint8_t* matrix, int64_t row_bytes, int64_t* pointer, uint8_t* bias, int bias_bytes,
                                 int64_t* slot_of, int64_t n_slots, const int64_t* sorted_rows, int64_t c,
                                 int64_t num_used, cudaStream_t stream);

cudaError_t launch_decode_attention(const float* q, const void* k, const void* v, int kind, const AttentionArgs& args,
                                    float* out, float* lse, cudaStream_t stream);

cudaError_t launch_merge_attention_states(const float* outs, const float* lses, int64_t n_parts, int64_t n_rows,
                                          int64_t head_dim, float* out, float* lse, cudaStream_t stream);

}  // namespace flashllm
