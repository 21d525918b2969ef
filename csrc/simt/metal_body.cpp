// The Metal Endor kernel body, #included into a C++ function whose parameters carry the names MLX generates, and
// run over the SIMT emulation.
#include "simt/simt_metal.h"

#include "common/word_dispatch.h"
#include "simt/bodies.h"

namespace flashllm::simt_bodies {
namespace {

template <class T, bool HAS_ROWS>
void endor_decompress_metal(const T* values, const uint8_t* bitmap, const int64_t* row_offsets, const int64_t* rows,
                            const int64_t* params, T* out, int32_t* row_status, uint3 thread_position_in_grid,
                            uint thread_index_in_simdgroup) {
#include "simt/metal_begin.h"
#include "../../metal/endor_decompress.metal"
#include "simt/metal_end.h"
}

template <class T, bool HAS_ROWS>
void run_typed(const void* values, const uint8_t* bitmap, const int64_t* row_offsets, const int64_t* rows,
               const int64_t* params, int64_t n_out, void* out, int32_t* row_status) {
  const uint64_t threads = uint64_t(32) * n_out;
  const uint64_t grid = (threads + kMetalThreadgroup - 1) / kMetalThreadgroup * kMetalThreadgroup;
  if (grid > UINT32_MAX) throw std::invalid_argument("run_endor_metal: too many rows for one dispatch");
  simt::dispatch_threads(uint3{unsigned(grid), 1, 1}, uint3{kMetalThreadgroup, 1, 1}, [&](const simt::MetalThread& t) {
    endor_decompress_metal<T, HAS_ROWS>(static_cast<const T*>(values), bitmap, row_offsets, rows, params,
                                        static_cast<T*>(out), row_status, t.thread_position_in_grid,
                                        t.thread_index_in_simdgroup);
  });
}

template <class T>
void run_rows(bool has_rows, const void* values, const uint8_t* bitmap, const int64_t* row_offsets, const int64_t* rows,
              const int64_t* params, int64_t n_out, void* out, int32_t* row_status) {
  if (has_rows)
    run_typed<T, true>(values, bitmap, row_offsets, rows, params, n_out, out, row_status);
  else
    run_typed<T, false>(values, bitmap, row_offsets, rows, params, n_out, out, row_status);
}

}  // namespace

void run_endor_metal(const void* values, int elem_bytes, const uint8_t* bitmap, const int64_t* row_offsets,
                     const int64_t* rows, int64_t n_rows, int64_t n_cols, int64_t nnz, int64_t n_out, void* out,
                     int32_t* row_status) {
  const int64_t params[4] = {n_rows, n_cols, nnz, n_out};
  const bool has_rows = rows != nullptr;
  dispatch_word(elem_bytes, [&](auto word) {
    run_rows<decltype(word)>(has_rows, values, bitmap, row_offsets, rows, params, n_out, out, row_status);
  });
}

}  // namespace flashllm::simt_bodies
