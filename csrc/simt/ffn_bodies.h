// The sparse FFN and cache compaction GPU kernel bodies compiled for the CPU SIMT emulation, behind plain functions
// (no torch headers on the body side). The launch geometry is the real launchers' (common/ffn_grid.h,
// flashllm_ext/mlx).
#pragma once
#include <cstdint>

namespace flashllm::simt_bodies {

// Runs the three kernels of csrc/cuda/sparse_ffn_kernel.cuh as launch_sparse_ffn does (token groups of 8).
// act_buf, partial: scratch sized as in kernels.cuh.
void run_sparse_ffn_cuda(const float* x, int64_t n_tok, int64_t d, const void* matrix, int kind, const void* bias,
                         const int64_t* index, int64_t n_rows, int64_t num_used, int act, bool glu, float threshold,
                         float* act_buf, float* partial, float* y);

// Runs compact_forget_kernel (when slot_of) and compact_move_kernel as launch_cache_compact does.
void run_cache_compact_cuda(uint8_t* matrix, int64_t row_bytes, int64_t* pointer, uint8_t* bias, int bias_bytes,
                            int64_t* slot_of, const int64_t* sorted_rows, int64_t c, int64_t holes, int64_t num_used);

// Runs metal/sparse_ffn_act.metal then metal/sparse_ffn_down.metal with the grids flashllm_ext.mlx uses, for at
// most 8 tokens. partial: [chunks * n_tok * d], chunks = ffn_grid(n_rows, d, elem).chunks. The caller sums it.
void run_sparse_ffn_metal(const float* x, int64_t n_tok, int64_t d, const void* matrix, int kind, const void* bias,
                          const int64_t* index, int64_t n_rows, int64_t num_used, int act, bool glu, float threshold,
                          float* act_buf, int64_t chunks, int64_t rows_per_chunk, float* partial);

// Threads per threadgroup of the Metal sparse FFN kernels; flashllm_ext/mlx uses the same.
constexpr unsigned kFfnMetalThreadgroup = 256;

}  // namespace flashllm::simt_bodies
