// The sparse FFN and cache compaction GPU launchers and kernel bodies compiled for the CPU SIMT emulation, behind
// plain functions (no torch headers on the body side). The CUDA ones are the CUDA build's launchers
// (csrc/simt/cuda_launchers.cpp); the Metal one follows flashllm_ext.mlx.
#pragma once
#include <cstdint>

namespace flashllm::simt_bodies {

// Run the CUDA build's launch_sparse_ffn (csrc/cuda/sparse_ffn_kernel.cuh; act_buf and partial sized as it says)
// and launch_cache_compact (csrc/cuda/cache_compact_kernel.cuh).
void run_sparse_ffn_cuda(const float* x, int64_t n_tok, int64_t d, const void* matrix, int kind, const void* bias,
                         const int64_t* index, int64_t n_rows, int64_t num_used, int act, bool glu, float threshold,
                         float* act_buf, float* partial, float* y);
// Runs the CUDA build's launch_quantized_sparse_ffn (csrc/cuda/quantized_sparse_ffn_kernel.cuh; scratch sized as it
// says).
void run_quantized_sparse_ffn_cuda(const float* x, int64_t n_tok, int64_t d, const uint8_t* matrix, int64_t row_bytes,
                                   int in_format, int down_format, const float* bias, const int64_t* index,
                                   int64_t n_rows, int64_t num_used, int act, bool glu, float threshold, int8_t* codes,
                                   float* scale, float* scaled_sum, float* act_buf, float* partial, float* y);
void run_cache_compact_cuda(uint8_t* matrix, int64_t row_bytes, int64_t* pointer, uint8_t* bias, int bias_bytes,
                            int64_t* slot_of, int64_t n_slots, const int64_t* sorted_rows, int64_t c, int64_t num_used);

// Runs metal/sparse_ffn_act.metal then metal/sparse_ffn_down.metal with the grids flashllm_ext.mlx uses, for at
// most 8 tokens. partial: [chunks * n_tok * d], chunks = ffn_grid(n_rows, d, elem).chunks. The caller sums it.
void run_sparse_ffn_metal(const float* x, int64_t n_tok, int64_t d, const void* matrix, int kind, const void* bias,
                          const int64_t* index, int64_t n_rows, int64_t num_used, int act, bool glu, float threshold,
                          float* act_buf, int64_t chunks, int64_t rows_per_chunk, float* partial);

// Runs metal/quantize_x_blocks.metal over n_tok tokens: codes [n_tok][ceil(d / 32) * 32], scale and scaled_sum
// [n_tok][ceil(d / 32)].
void run_quantize_x_metal(const float* x, int64_t n_tok, int64_t d, int8_t* codes, float* scale, float* scaled_sum);
// Runs metal/quantized_sparse_ffn_act.metal then quantized_sparse_ffn_down.metal as flashllm_ext.mlx does, for at
// most 8 tokens already quantized (codes, scale, scaled_sum: that group's); bias float32 or null; partial as
// run_sparse_ffn_metal's.
void run_quantized_sparse_ffn_metal(const int8_t* codes, const float* scale, const float* scaled_sum, int64_t n_tok,
                                    int64_t d, const uint8_t* matrix, int64_t row_bytes, int64_t col_bytes,
                                    int in_format, int down_format, const float* bias, const int64_t* index,
                                    int64_t n_rows, int64_t num_used, int act, bool glu, float threshold,
                                    float* act_buf, int64_t chunks, int64_t rows_per_chunk, float* partial);

// Threads per threadgroup of the Metal sparse FFN kernels; flashllm_ext/mlx uses the same.
constexpr unsigned kFfnMetalThreadgroup = 256;

}  // namespace flashllm::simt_bodies
