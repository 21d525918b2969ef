// The Metal endor_linear kernel body, #included into a C++ function whose parameters carry the names MLX generates,
// run over the SIMT emulation.
#include "simt/simt_metal.h"

#include <stdexcept>

#include "common/ffn_grid.h"
#include "simt/bodies.h"
#include "simt/metal_types.h"

namespace flashllm::simt_bodies {
namespace {

template <class T, bool HAS_BIAS>
void endor_linear_metal(const float* x, const T* values, const uint8_t* bitmap, const int64_t* row_offsets,
                        const float* bias, const int64_t* params, float* y, int32_t* row_status,
                        uint3 thread_position_in_grid, uint thread_index_in_simdgroup) {
#include "simt/metal_begin.h"
#include "../../metal/endor_linear.metal"
#include "simt/metal_end.h"
}

template <class T, bool HAS_BIAS>
void run_typed(const float* x, const void* values, const uint8_t* bitmap, const int64_t* row_offsets, const float* bias,
               const int64_t* params, int64_t n_rows, float* y, int32_t* row_status) {
  const uint64_t threads = uint64_t(32) * n_rows;
  const uint64_t grid = (threads + kMetalThreadgroup - 1) / kMetalThreadgroup * kMetalThreadgroup;
  if (grid > UINT32_MAX) throw std::invalid_argument("run_endor_linear_metal: too many rows for one dispatch");
  simt::dispatch_threads(uint3{unsigned(grid), 1, 1}, uint3{kMetalThreadgroup, 1, 1}, [&](const simt::MetalThread& t) {
    endor_linear_metal<T, HAS_BIAS>(x, static_cast<const T*>(values), bitmap, row_offsets, bias, params, y, row_status,
                                    t.thread_position_in_grid, t.thread_index_in_simdgroup);
  });
}

template <class T>
void run_bias(const float* x, const void* values, const uint8_t* bitmap, const int64_t* row_offsets, const float* bias,
              const int64_t* params, int64_t n_rows, float* y, int32_t* row_status) {
  if (bias != nullptr)
    run_typed<T, true>(x, values, bitmap, row_offsets, bias, params, n_rows, y, row_status);
  else
    run_typed<T, false>(x, values, bitmap, row_offsets, bias, params, n_rows, y, row_status);
}

}  // namespace

void run_endor_linear_metal(const float* x, int64_t n_tok, const void* values, int kind, const uint8_t* bitmap,
                            const int64_t* row_offsets, int64_t n_rows, int64_t n_cols, int64_t nnz, const float* bias,
                            float* y, int32_t* row_status) {
  if (n_tok > 8) throw std::invalid_argument("run_endor_linear_metal: at most 8 tokens per dispatch");
  const int64_t params[4] = {n_rows, n_cols, nnz, n_tok};
  switch (kind) {
    case kFfnF32:
      return run_bias<float>(x, values, bitmap, row_offsets, bias, params, n_rows, y, row_status);
    case kFfnF16:
      return run_bias<half>(x, values, bitmap, row_offsets, bias, params, n_rows, y, row_status);
    case kFfnBF16:
      return run_bias<bfloat16_t>(x, values, bitmap, row_offsets, bias, params, n_rows, y, row_status);
    default:
      throw std::invalid_argument("run_endor_linear_metal: unknown element kind");
  }
}

}  // namespace flashllm::simt_bodies
