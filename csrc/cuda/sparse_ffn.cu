// Instantiations and host launchers of the CUDA sparse FFN and cache compaction kernels.
#include "cuda/kernels.cuh"
#include "cuda/sparse_ffn_kernel.cuh"

namespace flashllm {

namespace {

template <int KIND>
cudaError_t launch_ffn_typed(const float* x, int64_t n_tok, int64_t d, const void* matrix, const void* bias,
                             const int64_t* index, int64_t n_rows, int64_t num_used, int act, bool glu,
                             float threshold, float* act_buf, float* partial, float* y, cudaStream_t stream) {
  using S = ffn_detail::Storage<KIND>;
  const FfnGrid g = ffn_grid(n_rows, d, int(sizeof(S)));
  const bool vector = reinterpret_cast<uintptr_t>(matrix) % 16 == 0 && (d * int64_t(sizeof(S))) % 16 == 0;
  for (int64_t t0 = 0; t0 < n_tok; t0 += kFfnMaxTokens) {
    const int nt = int(n_tok - t0 < kFfnMaxTokens ? n_tok - t0 : kFfnMaxTokens);
    ffn_act_kernel<KIND><<<unsigned(g.act_blocks), kFfnActWarps * 32, 0, stream>>>(
        x + t0 * d, static_cast<const S*>(matrix), static_cast<const S*>(bias), index, n_rows, num_used, d, nt, act,
        glu, threshold, vector, act_buf);
    ffn_down_kernel<KIND><<<dim3(unsigned(g.col_blocks), unsigned(g.chunks)), kFfnDownThreads, 0, stream>>>(
        static_cast<const S*>(matrix), index, act_buf, n_rows, num_used, d, nt, glu, g.rows_per_chunk, vector,
        partial);
    const int64_t n = nt * d;
    const int64_t blocks = (n + kFfnReduceThreads - 1) / kFfnReduceThreads;
    ffn_reduce_kernel<<<unsigned(blocks < kFfnMaxBlocks ? blocks : kFfnMaxBlocks), kFfnReduceThreads, 0, stream>>>(
        partial, g.chunks, n, y + t0 * d);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_sparse_ffn(const float* x, int64_t n_tok, int64_t d, const void* matrix, int kind,
                              const void* bias, const int64_t* index, int64_t n_rows, int64_t num_used, int act,
                              bool glu, float threshold, float* act_buf, float* partial, float* y,
                              cudaStream_t stream) {
  switch (kind) {
    case kFfnF32:
      return launch_ffn_typed<kFfnF32>(x, n_tok, d, matrix, bias, index, n_rows, num_used, act, glu, threshold,
                                       act_buf, partial, y, stream);
    case kFfnF16:
      return launch_ffn_typed<kFfnF16>(x, n_tok, d, matrix, bias, index, n_rows, num_used, act, glu, threshold,
                                       act_buf, partial, y, stream);
    case kFfnBF16:
      return launch_ffn_typed<kFfnBF16>(x, n_tok, d, matrix, bias, index, n_rows, num_used, act, glu, threshold,
                                        act_buf, partial, y, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t launch_cache_compact(uint8_t* matrix, int64_t row_bytes, int64_t* pointer, uint8_t* bias, int bias_bytes,
                                 int64_t* slot_of, const int64_t* sorted_rows, int64_t c, int64_t holes,
                                 int64_t num_used, cudaStream_t stream) {
  const int64_t n_new = num_used - c;
  if (c == 0) return cudaSuccess;
  if (slot_of != nullptr) {
    const int64_t blocks = (c + kCompactThreads - 1) / kCompactThreads;
    compact_forget_kernel<<<unsigned(blocks), kCompactThreads, 0, stream>>>(sorted_rows, c, pointer, slot_of);
  }
  const bool vector = reinterpret_cast<uintptr_t>(matrix) % 16 == 0 && row_bytes % 16 == 0;
  compact_move_kernel<<<unsigned(c), kCompactThreads, 0, stream>>>(matrix, row_bytes, vector, pointer, bias,
                                                                    bias_bytes, slot_of, sorted_rows, c, holes, n_new);
  return cudaGetLastError();
}

}  // namespace flashllm
