// The CUDA sparse FFN and cache compaction kernel bodies, compiled as C++ over the SIMT emulation.
#include "simt/simt.h"

#include <stdexcept>

#include "cuda/sparse_ffn_kernel.cuh"
#include "simt/ffn_bodies.h"

namespace flashllm::simt_bodies {
namespace {

template <int KIND>
void run_ffn_typed(const float* x, int64_t n_tok, int64_t d, const void* matrix, const void* bias,
                   const int64_t* index, int64_t n_rows, int64_t num_used, int act, bool glu, float threshold,
                   float* act_buf, float* partial, float* y) {
  using S = ffn_detail::Storage<KIND>;
  const FfnGrid g = ffn_grid(n_rows, d, int(sizeof(S)));
  const bool vector = reinterpret_cast<uintptr_t>(matrix) % 16 == 0 && (d * int64_t(sizeof(S))) % 16 == 0;
  for (int64_t t0 = 0; t0 < n_tok; t0 += kFfnMaxTokens) {
    const int nt = int(n_tok - t0 < kFfnMaxTokens ? n_tok - t0 : kFfnMaxTokens);
    simt::launch(dim3(unsigned(g.act_blocks)), dim3(kFfnActWarps * 32), [&] {
      ffn_act_kernel<KIND>(x + t0 * d, static_cast<const S*>(matrix), static_cast<const S*>(bias), index, n_rows,
                           num_used, d, nt, act, glu, threshold, vector, act_buf);
    });
    simt::launch(dim3(unsigned(g.col_blocks), unsigned(g.chunks)), dim3(kFfnDownThreads), [&] {
      ffn_down_kernel<KIND>(static_cast<const S*>(matrix), index, act_buf, n_rows, num_used, d, nt, glu,
                            g.rows_per_chunk, vector, partial);
    });
    const int64_t n = nt * d;
    const int64_t blocks = (n + kFfnReduceThreads - 1) / kFfnReduceThreads;
    simt::launch(dim3(unsigned(blocks < kFfnMaxBlocks ? blocks : kFfnMaxBlocks)), dim3(kFfnReduceThreads),
                 [&] { ffn_reduce_kernel(partial, g.chunks, n, y + t0 * d); });
  }
}

}  // namespace

void run_sparse_ffn_cuda(const float* x, int64_t n_tok, int64_t d, const void* matrix, int kind, const void* bias,
                         const int64_t* index, int64_t n_rows, int64_t num_used, int act, bool glu, float threshold,
                         float* act_buf, float* partial, float* y) {
  switch (kind) {
    case kFfnF32:
      return run_ffn_typed<kFfnF32>(x, n_tok, d, matrix, bias, index, n_rows, num_used, act, glu, threshold, act_buf,
                                    partial, y);
    case kFfnF16:
      return run_ffn_typed<kFfnF16>(x, n_tok, d, matrix, bias, index, n_rows, num_used, act, glu, threshold, act_buf,
                                    partial, y);
    case kFfnBF16:
      return run_ffn_typed<kFfnBF16>(x, n_tok, d, matrix, bias, index, n_rows, num_used, act, glu, threshold,
                                     act_buf, partial, y);
    default:
      throw std::invalid_argument("run_sparse_ffn_cuda: unknown element kind");
  }
}

void run_cache_compact_cuda(uint8_t* matrix, int64_t row_bytes, int64_t* pointer, uint8_t* bias, int bias_bytes,
                            int64_t* slot_of, const int64_t* sorted_rows, int64_t c, int64_t holes, int64_t num_used) {
  if (c == 0) return;
  if (slot_of != nullptr) {
    simt::launch(dim3(unsigned((c + kCompactThreads - 1) / kCompactThreads)), dim3(kCompactThreads),
                 [&] { compact_forget_kernel(sorted_rows, c, pointer, slot_of); });
  }
  const bool vector = reinterpret_cast<uintptr_t>(matrix) % 16 == 0 && row_bytes % 16 == 0;
  simt::launch(dim3(unsigned(c)), dim3(kCompactThreads), [&] {
    compact_move_kernel(matrix, row_bytes, vector, pointer, bias, bias_bytes, slot_of, sorted_rows, c, holes,
                        num_used - c);
  });
}

}  // namespace flashllm::simt_bodies
