// The Metal sparse FFN kernel bodies (float and quantized), #included into C++ functions whose parameters carry the
// names MLX generates, run over the SIMT emulation.
#include "simt/simt_metal.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "common/block_formats.h"
#include "common/ffn_grid.h"
#include "simt/ffn_bodies.h"
#include "simt/metal_types.h"

namespace metal {
// What the bodies use from the Metal standard library.
using std::exp;
using std::fabs;
using std::min;
using std::round;
namespace precise {
using std::tanh;
}  // namespace precise
}  // namespace metal

namespace flashllm::simt_bodies {
namespace {

// What flashllm_ext.mlx puts in the bodies' header besides the constants.
#include "simt/metal_begin.h"
#include "../../metal/activation.metal"
#include "../../metal/blocks.metal"
#include "simt/metal_end.h"

template <class T, bool HAS_INDEX, bool HAS_BIAS>
void ffn_act_metal(const float* x, const T* matrix, const T* bias, const int64_t* index, const int64_t* params,
                   const float* threshold, float* act, uint3 thread_position_in_grid, uint thread_index_in_simdgroup) {
#include "simt/metal_begin.h"
#include "../../metal/sparse_ffn_act.metal"
#include "simt/metal_end.h"
}

template <class T, bool HAS_INDEX>
void ffn_down_metal(const T* matrix, const int64_t* index, const float* act, const int64_t* params, float* partial,
                    uint3 thread_position_in_grid) {
#include "simt/metal_begin.h"
#include "../../metal/sparse_ffn_down.metal"
#include "simt/metal_end.h"
}

void quantize_x_metal(const float* x, const int64_t* params, int8_t* codes, float* scale, float* scaled_sum,
                      uint3 thread_position_in_grid, uint thread_index_in_simdgroup) {
#include "simt/metal_begin.h"
#include "../../metal/quantize_x_blocks.metal"
#include "simt/metal_end.h"
}

template <int IN_FMT, class T, bool HAS_INDEX, bool HAS_BIAS>
void quantized_ffn_act_metal(const int8_t* codes, const float* scale, const float* scaled_sum, const uint8_t* matrix,
                             const T* bias, const int64_t* index, const int64_t* params, const float* threshold,
                             float* act, uint3 thread_position_in_grid, uint thread_index_in_simdgroup) {
#include "simt/metal_begin.h"
#include "../../metal/quantized_sparse_ffn_act.metal"
#include "simt/metal_end.h"
}

template <int DOWN_FMT, bool HAS_INDEX>
void quantized_ffn_down_metal(const uint8_t* matrix, const int64_t* index, const float* act, const int64_t* params,
                              float* partial, uint3 thread_position_in_grid) {
#include "simt/metal_begin.h"
#include "../../metal/quantized_sparse_ffn_down.metal"
#include "simt/metal_end.h"
}

uint3 round_up_grid(uint64_t x, uint64_t y, unsigned group) {
  const uint64_t gx = (x + group - 1) / group * group;
  if (gx > UINT32_MAX || y > UINT32_MAX) throw std::invalid_argument("Metal emulation: grid too large");
  return uint3{unsigned(gx), unsigned(y), 1};
}

template <class T, bool HAS_INDEX, bool HAS_BIAS>
void run_typed(const float* x, int64_t n_tok, int64_t d, const void* matrix, const void* bias, const int64_t* index,
               int64_t n_rows, int64_t num_used, int act, bool glu, float threshold, float* act_buf, int64_t chunks,
               int64_t rows_per_chunk, float* partial) {
  const int64_t act_params[6] = {n_rows, num_used, d, n_tok, act, glu};
  const auto* m = static_cast<const T*>(matrix);
  simt::dispatch_threads(round_up_grid(uint64_t(32) * n_rows, 1, kFfnMetalThreadgroup),
                         uint3{kFfnMetalThreadgroup, 1, 1}, [&](const simt::MetalThread& t) {
                           ffn_act_metal<T, HAS_INDEX, HAS_BIAS>(x, m, static_cast<const T*>(bias), index, act_params,
                                                                 &threshold, act_buf, t.thread_position_in_grid,
                                                                 t.thread_index_in_simdgroup);
                         });
  const int64_t down_params[6] = {n_rows, num_used, d, n_tok, glu, rows_per_chunk};
  // MLX dispatches exactly (d, chunks) threads; threadgroups at the edge are cut short.
  simt::dispatch_threads(
      uint3{unsigned(d), unsigned(chunks), 1}, uint3{kFfnMetalThreadgroup, 1, 1}, [&](const simt::MetalThread& t) {
        ffn_down_metal<T, HAS_INDEX>(m, index, act_buf, down_params, partial, t.thread_position_in_grid);
      });
}

template <class F>
void with_flags(bool has_index, bool has_bias, F&& f) {
  using Yes = std::true_type;
  using No = std::false_type;
  if (has_index && has_bias)
    f(Yes{}, Yes{});
  else if (has_index)
    f(Yes{}, No{});
  else if (has_bias)
    f(No{}, Yes{});
  else
    f(No{}, No{});
}

template <class T>
void run_flags(bool has_index, bool has_bias, const float* x, int64_t n_tok, int64_t d, const void* matrix,
               const void* bias, const int64_t* index, int64_t n_rows, int64_t num_used, int act, bool glu,
               float threshold, float* act_buf, int64_t chunks, int64_t rows_per_chunk, float* partial) {
  auto run = [&](auto has_index_c, auto has_bias_c) {
    run_typed<T, decltype(has_index_c)::value, decltype(has_bias_c)::value>(x, n_tok, d, matrix, bias, index, n_rows,
                                                                            num_used, act, glu, threshold, act_buf,
                                                                            chunks, rows_per_chunk, partial);
  };
  with_flags(has_index, has_bias, run);
}

}  // namespace

void run_sparse_ffn_metal(const float* x, int64_t n_tok, int64_t d, const void* matrix, int kind, const void* bias,
                          const int64_t* index, int64_t n_rows, int64_t num_used, int act, bool glu, float threshold,
                          float* act_buf, int64_t chunks, int64_t rows_per_chunk, float* partial) {
  if (n_tok > kFfnMaxTokens) throw std::invalid_argument("run_sparse_ffn_metal: at most 8 tokens per dispatch");
  const bool has_index = index != nullptr, has_bias = bias != nullptr;
  switch (kind) {
    case kFfnF32:
      return run_flags<float>(has_index, has_bias, x, n_tok, d, matrix, bias, index, n_rows, num_used, act, glu,
                              threshold, act_buf, chunks, rows_per_chunk, partial);
    case kFfnF16:
      return run_flags<half>(has_index, has_bias, x, n_tok, d, matrix, bias, index, n_rows, num_used, act, glu,
                             threshold, act_buf, chunks, rows_per_chunk, partial);
    case kFfnBF16:
      return run_flags<bfloat16_t>(has_index, has_bias, x, n_tok, d, matrix, bias, index, n_rows, num_used, act, glu,
                                   threshold, act_buf, chunks, rows_per_chunk, partial);
    default:
      throw std::invalid_argument("run_sparse_ffn_metal: unknown element kind");
  }
}

void run_quantize_x_metal(const float* x, int64_t n_tok, int64_t d, int8_t* codes, float* scale, float* scaled_sum) {
  const int64_t n_blocks = (d + kBlock - 1) / kBlock;
  const int64_t params[3] = {n_tok, d, n_blocks};
  simt::dispatch_threads(round_up_grid(uint64_t(32) * n_tok * n_blocks, 1, kFfnMetalThreadgroup),
                         uint3{kFfnMetalThreadgroup, 1, 1}, [&](const simt::MetalThread& t) {
                           quantize_x_metal(x, params, codes, scale, scaled_sum, t.thread_position_in_grid,
                                            t.thread_index_in_simdgroup);
                         });
}

void run_quantized_sparse_ffn_metal(const int8_t* codes, const float* scale, const float* scaled_sum, int64_t n_tok,
                                    int64_t d, const uint8_t* matrix, int64_t row_bytes, int64_t col_bytes,
                                    int in_format, int down_format, const float* bias, const int64_t* index,
                                    int64_t n_rows, int64_t num_used, int act, bool glu, float threshold,
                                    float* act_buf, int64_t chunks, int64_t rows_per_chunk, float* partial) {
  if (n_tok > kFfnMaxTokens) throw std::invalid_argument("run_quantized_sparse_ffn_metal: at most 8 tokens");
  if (!is_block_format(in_format) || !is_block_format(down_format))
    throw std::invalid_argument("run_quantized_sparse_ffn_metal: unknown block format");
  const int64_t act_params[8] = {n_rows, num_used, d, n_tok, act, glu, row_bytes, col_bytes};
  const int64_t down_params[7] = {n_rows, num_used, d, n_tok, rows_per_chunk, row_bytes, (glu ? 2 : 1) * col_bytes};
  with_flags(index != nullptr, bias != nullptr, [&](auto has_index_c, auto has_bias_c) {
    constexpr bool HAS_INDEX = decltype(has_index_c)::value, HAS_BIAS = decltype(has_bias_c)::value;
    with_block_format(in_format, [&](auto in) {
      simt::dispatch_threads(round_up_grid(uint64_t(32) * n_rows, 1, kFfnMetalThreadgroup),
                             uint3{kFfnMetalThreadgroup, 1, 1}, [&](const simt::MetalThread& t) {
                               quantized_ffn_act_metal<decltype(in)::value, float, HAS_INDEX, HAS_BIAS>(
                                   codes, scale, scaled_sum, matrix, bias, index, act_params, &threshold, act_buf,
                                   t.thread_position_in_grid, t.thread_index_in_simdgroup);
                             });
    });
    with_block_format(down_format, [&](auto down) {
      simt::dispatch_threads(uint3{unsigned(d), unsigned(chunks), 1}, uint3{kFfnMetalThreadgroup, 1, 1},
                             [&](const simt::MetalThread& t) {
                               quantized_ffn_down_metal<decltype(down)::value, HAS_INDEX>(
                                   matrix, index, act_buf, down_params, partial, t.thread_position_in_grid);
                             });
    });
  });
}

}  // namespace flashllm::simt_bodies
