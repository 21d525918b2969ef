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
