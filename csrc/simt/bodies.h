// The GPU kernel bodies compiled for the CPU SIMT emulation, behind plain functions (the Metal body needs a
// translation unit of its own: its qualifier macros would break C++ headers).
#pragma once
#include <cstdint>

#include "common/endor_codes.h"

namespace flashllm::simt_bodies {

// Runs the CUDA build's launch_endor_decompress (csrc/cuda/endor_decompress_kernel.cuh). Returns its report.
EndorReport run_endor_cuda(const void* values, int elem_bytes, const uint8_t* bitmap, const int64_t* row_offsets,
                           const int64_t* rows, int64_t n_rows, int64_t n_cols, int64_t nnz, int64_t n_out, void* out);

// Runs the CUDA build's launch_endor_linear (csrc/cuda/endor_linear_kernel.cuh); it writes `report`.
void run_endor_linear_cuda(const float* x, int64_t n_tok, const void* values, int kind, const uint8_t* bitmap,
                           const int64_t* row_offsets, int64_t n_rows, int64_t n_cols, int64_t nnz, const float* bias,
                           float* y, EndorReport* report);

// Runs the CUDA build's launch_quantized_linear (csrc/cuda/quantized_linear_kernel.cuh).
void run_quantized_linear_cuda(const float* x, int64_t n_tok, int64_t d, const uint8_t* w, int format, int64_t n_rows,
                               const float* bias, int8_t* codes, float* scale, float* scaled_sum, float* y);

// Runs metal/endor_linear.metal for at most 8 tokens with the grid flashllm_ext/mlx uses. row_status: [n_rows] int32.
void run_endor_linear_metal(const float* x, int64_t n_tok, const void* values, int kind, const uint8_t* bitmap,
                            const int64_t* row_offsets, int64_t n_rows, int64_t n_cols, int64_t nnz, const float* bias,
                            float* y, int32_t* row_status);

// Runs metal/endor_decompress.metal with the grid flashllm_ext/mlx uses. row_status: [n_out] int32.
void run_endor_metal(const void* values, int elem_bytes, const uint8_t* bitmap, const int64_t* row_offsets,
                     const int64_t* rows, int64_t n_rows, int64_t n_cols, int64_t nnz, int64_t n_out, void* out,
                     int32_t* row_status);

// Threads per threadgroup of the Metal launch; flashllm_ext/mlx uses the same.
constexpr unsigned kMetalThreadgroup = 256;

}  // namespace flashllm::simt_bodies
