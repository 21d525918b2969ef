// The CUDA Endor kernel body, compiled as C++ over the SIMT emulation.
#include "simt/simt.h"

#include "cuda/endor_decompress_kernel.cuh"
#include "common/word_dispatch.h"
#include "simt/bodies.h"

namespace flashllm::simt_bodies {
namespace {

template <class W>
EndorReport run_typed(const void* values, const uint8_t* bitmap, const int64_t* row_offsets,
                             const int64_t* rows, int64_t n_rows, int64_t n_cols, int64_t nnz, int64_t n_out,
                             void* out) {
  EndorReport report{kEndorNoError, -1, -1};
  simt::launch(dim3(static_cast<unsigned>(endor_grid_blocks(n_out))), dim3(kEndorThreadsPerBlock), [&] {
    endor_decompress_kernel<W>(static_cast<const W*>(values), bitmap, row_offsets, rows, n_rows, n_cols, nnz, n_out,
                               static_cast<W*>(out), &report);
  });
  return report;
}

}  // namespace

EndorReport run_endor_cuda(const void* values, int elem_bytes, const uint8_t* bitmap, const int64_t* row_offsets,
                                  const int64_t* rows, int64_t n_rows, int64_t n_cols, int64_t nnz, int64_t n_out,
                                  void* out) {
  return dispatch_word(elem_bytes, [&](auto word) {
    return run_typed<decltype(word)>(values, bitmap, row_offsets, rows, n_rows, n_cols, nnz, n_out, out);
  });
}

}  // namespace flashllm::simt_bodies
