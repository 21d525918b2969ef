// Host launchers of the CUDA kernels: raw pointers and sizes in, cudaError_t out. No torch headers here; the torch
// glue (ops_cuda.cpp) checks arguments and calls these on the current stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/endor_codes.h"

namespace flashllm {

// Decompresses n_out rows of an Endor tensor (see endor_decompress_kernel.cuh) into the contiguous [n_out, n_cols]
// `out`. elem_bytes is 1, 2 or 4: elements are moved as bits. rows may be null (all rows, n_out == n_rows).
// `report` is device memory the launcher initialises; once the stream reaches it, it says which rows were refused
// (EndorReport, endor_codes.h).
cudaError_t launch_endor_decompress(const void* values, int elem_bytes, const uint8_t* bitmap,
                                    const int64_t* row_offsets, const int64_t* rows, int64_t n_rows, int64_t n_cols,
                                    int64_t nnz, int64_t n_out, void* out, EndorReport* report,
                                    cudaStream_t stream);

}  // namespace flashllm

namespace flashllm {

// y [n_tok, d] float32 = flashllm::sparse_ffn of x [n_tok, d] float32 over n_rows rows of the bundle matrix
// (sparse_ffn_kernel.cuh). kind: FfnKind of matrix and bias. index may be null (rows [0, n_rows)); entries must lie
// in [0, num_used) (the kernels skip others). Scratch: act_buf [min(n_tok, 8) * n_rows] and partial
// [ffn_grid(...).chunks * min(n_tok, 8) * d] floats.
cudaError_t launch_sparse_ffn(const float* x, int64_t n_tok, int64_t d, const void* matrix, int kind,
                              const void* bias, const int64_t* index, int64_t n_rows, int64_t num_used, int act,
                              bool glu, float threshold, float* act_buf, float* partial, float* y,
                              cudaStream_t stream);

// Swap-delete of the c rows sorted_rows (ascending, distinct, < num_used; `holes` of them below num_used - c) in
// place: matrix rows of row_bytes, pointer, bias entries of bias_bytes (bias may be null), slot_of (may be null).
cudaError_t launch_cache_compact(uint8_t* matrix, int64_t row_bytes, int64_t* pointer, uint8_t* bias, int bias_bytes,
                                 int64_t* slot_of, const int64_t* sorted_rows, int64_t c, int64_t holes,
                                 int64_t num_used, cudaStream_t stream);

}  // namespace flashllm
