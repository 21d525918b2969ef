// Host side of the GPU-style sparse_ffn and cache_compact kernels (the CUDA glue and the SIMT test ops run the same
// code with a different launcher): data checks made with tensor ops on the kernels' device, one small copy back,
// scratch allocation, and the float32 -> dtype cast of the result.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "common/cache_compact_checks.h"
#include "common/ffn_grid.h"
#include "common/sparse_ffn_checks.h"

namespace flashllm {

// Raises unless every entry of `ids` lies in [0, limit); `what` names the argument in the message.
inline void check_ids_below(const at::Tensor& ids, int64_t limit, const char* op, const char* what,
                            const char* limit_name) {
  if (ids.numel() == 0) return;
  const at::Tensor bad = (ids < 0).logical_or_(ids >= limit);
  if (!bad.any().item<bool>()) return;
  const int64_t k = bad.nonzero()[0][0].item<int64_t>();
  TORCH_CHECK(false, op, ": ", what, "[", k, "]=", ids[k].item<int64_t>(), " is outside [0, ", limit_name, "=", limit,
              ")");
}

inline FfnKind ffn_kind(at::ScalarType t) { return t == at::kFloat ? kFfnF32 : t == at::kHalf ? kFfnF16 : kFfnBF16; }

// launch(x_f32 [T, d], n_rows, index or nullptr, act code, y_f32 [T, d]) runs the kernels; the result is cast to x's
// dtype.
template <class Launch>
at::Tensor sparse_ffn_gpu_style(const at::Tensor& x, const at::Tensor& matrix, int64_t num_used,
                                const std::optional<at::Tensor>& bias, c10::string_view activation, bool glu,
                                const std::optional<at::Tensor>& index, double threshold, Launch&& launch) {
  const int64_t d = check_sparse_ffn_args(x, matrix, num_used, bias, glu, index, threshold);
  const int act = parse_ffn_activation(std::string(activation));
  std::optional<at::Tensor> index_c;
  int64_t n_rows = num_used;
  if (index.has_value()) {
    index_c = index->contiguous();
    check_ids_below(*index_c, num_used, "sparse_ffn", "index", "num_used");
    n_rows = index_c->numel();
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::zeros({x.size(0), d}, xf.options());
  if (x.size(0) > 0 && n_rows > 0 && d > 0)
    launch(xf, n_rows, index_c.has_value() ? index_c->data_ptr<int64_t>() : nullptr, act, y);
  return y.to(x.scalar_type());
}

// What the compaction kernels need: the deleted rows sorted, and how many lie below the new end.
struct CompactPlan {
  at::Tensor sorted;
  int64_t holes;
};

inline CompactPlan plan_cache_compact(const at::Tensor& pointer, const std::optional<at::Tensor>& slot_of,
                                      int64_t num_used, const at::Tensor& rows) {
  CompactPlan plan{std::get<0>(at::sort(rows.contiguous())), 0};
  const int64_t c = rows.numel();
  if (c == 0) return plan;
  check_ids_below(plan.sorted, num_used, "cache_compact", "rows (sorted)", "num_used");
  TORCH_CHECK(c == 1 || !plan.sorted.diff().eq(0).any().item<bool>(), "cache_compact: rows holds a row twice");
  if (slot_of.has_value())
    check_ids_below(pointer.slice(0, 0, num_used), slot_of->numel(), "cache_compact", "pointer", "slot_of.numel()");
  plan.holes = plan.sorted.lt(num_used - c).sum().item<int64_t>();
  return plan;
}

}  // namespace flashllm
