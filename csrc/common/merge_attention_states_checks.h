// Argument checks of flashllm::merge_attention_states shared by every native kernel (CPU, CUDA, SIMT test ops);
// flashllm_ext/ops/attention.py makes the same checks for the reference kernel, with the same words. The merge's rule
// for each (b, h), the same in every kernel: top = max_p lse_p (NaN if any is NaN; 0 when every part is empty), total =
// sum_p exp(lse_p - top), lse = top + log(total), w_p = exp(lse_p - top) / total (total 0: w_p 0), and out = sum over
// the parts with w_p != 0 of w_p out_p (an empty part's out_p is never read).
#pragma once
#include <ATen/ATen.h>
#include <torch/library.h>

namespace flashllm {

inline void check_merge_attention_states_args(const at::Tensor& outs, const at::Tensor& lses) {
  TORCH_CHECK(outs.scalar_type() == at::kFloat && outs.dim() == 4,
              "merge_attention_states: outs must be a 4-D float32 tensor [P, B, H, D], got ", outs.scalar_type(),
              " of shape ", outs.sizes());
  TORCH_CHECK(lses.scalar_type() == at::kFloat && lses.dim() == 3,
              "merge_attention_states: lses must be a 3-D float32 tensor [P, B, H], got ", lses.scalar_type(),
              " of shape ", lses.sizes());
  TORCH_CHECK(lses.sizes() == outs.sizes().slice(0, 3),
              "merge_attention_states: lses must be [P, B, H] = ", outs.sizes().slice(0, 3), " to match outs ",
              outs.sizes(), ", got ", lses.sizes());
  TORCH_CHECK(lses.device() == outs.device(), "merge_attention_states: lses is on ", lses.device(), " but outs is on ",
              outs.device());
}

}  // namespace flashllm
