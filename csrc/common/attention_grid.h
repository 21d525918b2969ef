// Launch geometry and plain arguments of the GPU attention kernels (csrc/cuda/decode_attention_kernel.cuh,
// csrc/cuda/merge_attention_states_kernel.cuh), shared by the launchers, the torch glue and the SIMT test ops. Plain
// C++, no CUDA headers.
#pragma once
#include <cstdint>

namespace flashllm {

constexpr int kAttentionWarps = 4;         // warps per decode_attention block, each over a chunk of the tokens
constexpr int kAttentionHeads = 4;         // query heads per block (a GQA group of more runs as several blocks)
constexpr int kAttentionMaxHeadDim = 256;  // head_dim the per-lane registers hold (8 elements per lane)
constexpr int kMergeWarps = 4;             // (b, h) rows per merge_attention_states block, one per warp

// One decode_attention call: q [batch, n_q_heads, head_dim] float32 contiguous (already multiplied by the scale),
// k and v [seq, batch, n_kv_heads, head_dim] with unit stride on head_dim and these strides (elements) on the
// others: token, sequence, kv head.
struct AttentionArgs {
  int64_t batch, n_q_heads, n_kv_heads, head_dim, seq;
  int64_t k_stride[3], v_stride[3];
};

}  // namespace flashllm
