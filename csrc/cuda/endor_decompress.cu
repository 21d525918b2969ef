// Instantiations and host launcher of the CUDA Endor decompression kernel.
#include "cuda/endor_decompress_kernel.cuh"
#include "cuda/kernels.cuh"
#include "common/word_dispatch.h"

namespace flashllm {

namespace {

template <class W>
cudaError_t launch_typed(const void* values, const uint8_t* bitmap, const int64_t* row_offsets, const int64_t* rows,
                         int64_t n_rows, int64_t n_cols, int64_t nnz, int64_t n_out, void* out,
                         EndorReport* report, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(endor_grid_blocks(n_out));
  endor_decompress_kernel<W><<<blocks, kEndorThreadsPerBlock, 0, stream>>>(
      static_cast<const W*>(values), bitmap, row_offsets, rows, n_rows, n_cols, nnz, n_out, static_cast<W*>(out),
      report);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_endor_decompress(const void* values, int elem_bytes, const uint8_t* bitmap,
                                    const int64_t* row_offsets, const int64_t* rows, int64_t n_rows, int64_t n_cols,
                                    int64_t nnz, int64_t n_out, void* out, EndorReport* report,
                                    cudaStream_t stream) {
  const cudaError_t reset = cudaMemsetAsync(&report->bad_row, 0xff, sizeof(report->bad_row), stream);  // kEndorNoError
  if (reset != cudaSuccess) return reset;
  if (elem_bytes != 1 && elem_bytes != 2 && elem_bytes != 4) return cudaErrorInvalidValue;
  return dispatch_word(elem_bytes, [&](auto word) {
    return launch_typed<decltype(word)>(values, bitmap, row_offsets, rows, n_rows, n_cols, nnz, n_out, out, report,
                                        stream);
  });
}

}  // namespace flashllm
