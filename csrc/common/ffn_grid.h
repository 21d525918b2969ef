// Launch geometry of the GPU sparse_ffn kernels (csrc/cuda/sparse_ffn_kernel.cuh), shared by the launcher, the
// torch glue (which sizes the scratch buffers from it) and the SIMT test ops. Plain C++, no CUDA headers.
#pragma once
#include <cstdint>

namespace flashllm {

constexpr int kFfnMaxTokens = 8;
constexpr int kFfnActWarps = 8;  // warps per block of ffn_act_kernel
constexpr int kFfnDownThreads = 128;
constexpr int kFfnTileRows = 64;  // rows of activations staged in shared memory per step of ffn_down_kernel
constexpr int kFfnRowsPerChunk = 16;
constexpr int kFfnMaxChunks = 32;  // bounds the partial-sum traffic to 32 x T x d floats
constexpr int kFfnReduceThreads = 256;
constexpr int64_t kFfnMaxBlocks = 65535;
enum FfnKind : int { kFfnF32 = 0, kFfnF16 = 1, kFfnBF16 = 2 };
// ffn_grid's elem_bytes for quantized_sparse_ffn's down kernel, whose threads take 8 columns (16 / 2) of a block.
constexpr int kQuantizedDownElemBytes = 2;

// Grid of the act and down kernels for n_rows rows, d columns, element size elem_bytes (the partial sums take
// chunks x min(T, kFfnMaxTokens) x d floats).
struct FfnGrid {
  int64_t act_blocks, col_blocks, chunks, rows_per_chunk;
};
inline FfnGrid ffn_grid(int64_t n_rows, int64_t d, int elem_bytes) {
  FfnGrid g;
  const int64_t act = (n_rows + kFfnActWarps - 1) / kFfnActWarps;
  g.act_blocks = act < 1 ? 1 : act < kFfnMaxBlocks ? act : kFfnMaxBlocks;
  const int64_t cols_per_block = int64_t(kFfnDownThreads) * (16 / elem_bytes);
  g.col_blocks = (d + cols_per_block - 1) / cols_per_block;
  if (g.col_blocks < 1) g.col_blocks = 1;
  int64_t chunks = (n_rows + kFfnRowsPerChunk - 1) / kFfnRowsPerChunk;
  g.chunks = chunks < 1 ? 1 : chunks < kFfnMaxChunks ? chunks : kFfnMaxChunks;
  g.rows_per_chunk = (n_rows + g.chunks - 1) / g.chunks;
  return g;
}

}  // namespace flashllm
