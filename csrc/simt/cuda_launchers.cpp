// The shipped CUDA launchers (the launch_* templates of csrc/cuda/*_kernel.cuh) instantiated with the SIMT
// emulation's launch policy: the grids, token loop and path choices tested here are the CUDA build's own.
#include "simt/simt.h"

#include <string>

#include "cuda/cache_compact_kernel.cuh"
#include "cuda/decode_attention_kernel.cuh"
#include "cuda/endor_decompress_kernel.cuh"
#include "cuda/endor_linear_kernel.cuh"
#include "cuda/merge_attention_states_kernel.cuh"
#include "cuda/quantized_linear_kernel.cuh"
#include "cuda/quantized_sparse_ffn_kernel.cuh"
#include "cuda/sparse_ffn_kernel.cuh"
#include "simt/attention_bodies.h"
#include "simt/bodies.h"
#include "simt/ffn_bodies.h"

namespace flashllm::simt_bodies {
namespace {

// The emulation throws when a kernel misbehaves; a status is left only for arguments the launcher refused.
void require_success(cudaError_t status, const char* launcher) {
  if (status != cudaSuccess) throw simt::LaunchError(std::string(launcher) + " refused its arguments");
}

}  // namespace

EndorReport run_endor_cuda(const void* values, int elem_bytes, const uint8_t* bitmap, const int64_t* row_offsets,
                           const int64_t* rows, int64_t n_rows, int64_t n_cols, int64_t nnz, int64_t n_out, void* out) {
  EndorReport report{};
  require_success(launch_endor_decompress(simt::EmulatedLaunch{}, values, elem_bytes, bitmap, row_offsets, rows, n_rows,
                                          n_cols, nnz, n_out, out, &report),
                  "launch_endor_decompress");
  return report;
}

void run_endor_linear_cuda(const float* x, int64_t n_tok, const void* values, int kind, const uint8_t* bitmap,
                           const int64_t* row_offsets, int64_t n_rows, int64_t n_cols, int64_t nnz, const float* bias,
                           float* y, EndorReport* report) {
  require_success(launch_endor_linear(simt::EmulatedLaunch{}, x, n_tok, values, kind, bitmap, row_offsets, n_rows,
                                      n_cols, nnz, bias, y, report),
                  "launch_endor_linear");
}

void run_quantized_linear_cuda(const float* x, int64_t n_tok, int64_t d, const uint8_t* w, int format, int64_t n_rows,
                               const float* bias, int8_t* codes, float* scale, float* scaled_sum, float* y) {
  require_success(launch_quantized_linear(simt::EmulatedLaunch{}, x, n_tok, d, w, format, n_rows, bias, codes, scale,
                                          scaled_sum, y),
                  "launch_quantized_linear");
}

void run_sparse_ffn_cuda(const float* x, int64_t n_tok, int64_t d, const void* matrix, int kind, const void* bias,
                         const int64_t* index, int64_t n_rows, int64_t num_used, int act, bool glu, float threshold,
                         float* act_buf, float* partial, float* y) {
  require_success(launch_sparse_ffn(simt::EmulatedLaunch{}, x, n_tok, d, matrix, kind, bias, index, n_rows, num_used,
                                    act, glu, threshold, act_buf, partial, y),
                  "launch_sparse_ffn");
}

void run_quantized_sparse_ffn_cuda(const float* x, int64_t n_tok, int64_t d, const uint8_t* matrix, int64_t row_bytes,
                                   int in_format, int down_format, const float* bias, const int64_t* index,
                                   int64_t n_rows, int64_t num_used, int act, bool glu, float threshold, int8_t* codes,
                                   float* scale, float* scaled_sum, float* act_buf, float* partial, float* y) {
  require_success(launch_quantized_sparse_ffn(simt::EmulatedLaunch{}, x, n_tok, d, matrix, row_bytes, in_format,
                                              down_format, bias, index, n_rows, num_used, act, glu, threshold, codes,
                                              scale, scaled_sum, act_buf, partial, y),
                  "launch_quantized_sparse_ffn");
}

void run_cache_compact_cuda(uint8_t* matrix, int64_t row_bytes, int64_t* pointer, uint8_t* bias, int bias_bytes,
                            int64_t* slot_of, int64_t n_slots, const int64_t* sorted_rows, int64_t c,
                            int64_t num_used) {
  require_success(launch_cache_compact(simt::EmulatedLaunch{}, matrix, row_bytes, pointer, bias, bias_bytes, slot_of,
                                       n_slots, sorted_rows, c, num_used),
                  "launch_cache_compact");
}

void run_decode_attention_cuda(const float* q, const void* k, const void* v, int kind, const AttentionArgs& args,
                               float* out, float* lse) {
  require_success(launch_decode_attention(simt::EmulatedLaunch{}, q, k, v, kind, args, out, lse),
                  "launch_decode_attention");
}

void run_merge_attention_states_cuda(const float* outs, const float* lses, int64_t n_parts, int64_t n_rows,
                                     int64_t head_dim, float* out, float* lse) {
  require_success(
      launch_merge_attention_states(simt::EmulatedLaunch{}, outs, lses, n_parts, n_rows, head_dim, out, lse),
      "launch_merge_attention_states");
}

}  // namespace flashllm::simt_bodies
