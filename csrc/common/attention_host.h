// Host side of the GPU-style decode_attention and merge_attention_states kernels (the CUDA glue and the SIMT test
// ops run the same code with a different launcher): argument checks, the layouts the kernels take (q as float32
// multiplied by the scale; k and v with unit stride on head_dim, any other strides; the merge's inputs contiguous),
// the outputs. Neither op has data to check, so neither ever synchronises.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <tuple>

#include "common/attention_grid.h"
#include "common/decode_attention_checks.h"
#include "common/ffn_host.h"
#include "common/merge_attention_states_checks.h"

namespace flashllm {

// launch(q_f32, k, v, kind, args, out, lse) runs the kernel; out [B, Hq, D] and lse [B, Hq] come back float32.
template <class Launch>
std::tuple<at::Tensor, at::Tensor> decode_attention_gpu_style(const at::Tensor& q, const at::Tensor& k_in,
                                                              const at::Tensor& v_in,
                                                              const std::optional<double>& scale_in, Launch&& launch) {
  double scale = 0;
  const AttentionShape s = check_decode_attention_args(q, k_in, v_in, scale_in, &scale);
  TORCH_CHECK(s.head_dim <= kAttentionMaxHeadDim,
              "decode_attention: the GPU kernel takes head_dim D <= ", kAttentionMaxHeadDim, ", got ", s.head_dim);
  const at::Tensor k = with_unit_inner_stride(k_in), v = with_unit_inner_stride(v_in);
  const at::Tensor qf = q.to(at::kFloat).mul(scale).contiguous();
  at::Tensor out = at::empty({s.batch, s.n_q_heads, s.head_dim}, qf.options());
  at::Tensor lse = at::empty({s.batch, s.n_q_heads}, qf.options());
  const AttentionArgs args{s.batch,
                           s.n_q_heads,
                           s.n_kv_heads,
                           s.head_dim,
                           s.seq,
                           {k.stride(0), k.stride(1), k.stride(2)},
                           {v.stride(0), v.stride(1), v.stride(2)}};
  if (s.batch > 0) launch(qf, k, v, static_cast<int>(ffn_kind(q.scalar_type())), args, out, lse);
  return {out, lse};
}

// launch(outs, lses, n_parts, n_rows, head_dim, out, lse) runs the kernel over contiguous inputs.
template <class Launch>
std::tuple<at::Tensor, at::Tensor> merge_attention_states_gpu_style(const at::Tensor& outs_in,
                                                                    const at::Tensor& lses_in, Launch&& launch) {
  check_merge_attention_states_args(outs_in, lses_in);
  const at::Tensor outs = outs_in.contiguous(), lses = lses_in.contiguous();
  at::Tensor out = at::empty({outs.size(1), outs.size(2), outs.size(3)}, outs.options());
  at::Tensor lse = at::empty({outs.size(1), outs.size(2)}, outs.options());
  const int64_t n_rows = outs.size(1) * outs.size(2);
  if (n_rows > 0) launch(outs, lses, outs.size(0), n_rows, outs.size(3), out, lse);
  return {out, lse};
}

}  // namespace flashllm
