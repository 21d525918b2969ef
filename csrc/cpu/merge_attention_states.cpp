// flashllm::merge_attention_states on the CPU: the exact log-sum-exp merge of P partial attention results, by the
// rule of common/merge_attention_states_checks.h (an empty part is skipped, all parts empty give out 0 and lse -inf).
// OpenMP over the (b, h) rows; the weighted sum over D is a plain loop the compiler vectorises.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

#include "common/merge_attention_states_checks.h"

namespace flashllm {
namespace {

std::tuple<at::Tensor, at::Tensor> merge_attention_states_cpu(const at::Tensor& outs_in, const at::Tensor& lses_in) {
  check_merge_attention_states_args(outs_in, lses_in);
  const at::Tensor outs = outs_in.contiguous(), lses = lses_in.contiguous();
  const int64_t n_parts = outs.size(0), n_rows = outs.size(1) * outs.size(2), D = outs.size(3);
  at::Tensor out = at::zeros({outs.size(1), outs.size(2), D}, outs.options());
  at::Tensor lse = at::empty({outs.size(1), outs.size(2)}, outs.options());
  const float* part_out = outs.data_ptr<float>();
  const float* part_lse = lses.data_ptr<float>();
  float* out_p = out.data_ptr<float>();
  float* lse_p = lse.data_ptr<float>();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for schedule(static) if (n_parts * n_rows * D >= (64 << 10))
  for (int64_t row = 0; row < n_rows; ++row) {
    float top = kNegInf;
    for (int64_t p = 0; p < n_parts; ++p) {
      const float x = part_lse[p * n_rows + row];
      top = std::isnan(x) || std::isnan(top) ? std::numeric_limits<float>::quiet_NaN() : std::max(top, x);
    }
    if (top == kNegInf) top = 0.f;  // every part empty: exp(-inf - 0) = 0, never exp(-inf - -inf)
    float total = 0.f;
    for (int64_t p = 0; p < n_parts; ++p) total += std::exp(part_lse[p * n_rows + row] - top);
    lse_p[row] = top + std::log(total);
    const float inv = total == 0.f ? 0.f : 1.f / total;
    float* dst = out_p + row * D;
    for (int64_t p = 0; p < n_parts; ++p) {
      const float w = std::exp(part_lse[p * n_rows + row] - top) * inv;
      if (w == 0.f) continue;  // an empty (or negligible) part: its out is not read
      const float* src = part_out + (p * n_rows + row) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] += w * src[d];
    }
  }
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashllm, CPU, m) {
  m.impl("merge_attention_states", &merge_attention_states_cpu);
}

}  // namespace flashllm
