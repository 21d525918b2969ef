// Host side of the GPU-style sparse_ffn and cache_compact kernels (the CUDA glue and the SIMT test ops run the same
// code with a different launcher): argument checks, the data checks when asked for (check_data: tensor ops on the
// kernels' device and small copies back, which synchronise; see common/kernel_checks.h), scratch allocation, and the
// float32 -> dtype cast of the result.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <optional>
#include <string>

#include "common/cache_compact_checks.h"
#include "common/ffn_grid.h"
#include "common/quantized_ffn_checks.h"
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

inline FfnKind ffn_kind(at::ScalarType t) {
  return t == at::kFloat ? kFfnF32 : t == at::kHalf ? kFfnF16 : kFfnBF16;
}

// What both GPU-style FFN ops run on once their arguments are checked: launch(x_f32 [T, d], n_rows, index or nullptr,
// act code, y_f32 [T, d]) runs the kernels; the result is cast to x's dtype. Unchecked index entries outside
// [0, num_used) contribute nothing (sparse_ffn_kernel.cuh).
template <class Launch>
at::Tensor ffn_rows_gpu_style(const char* op, const at::Tensor& x, int64_t d, int64_t num_used,
                              c10::string_view activation, const std::optional<at::Tensor>& index, bool check_data,
                              Launch&& launch) {
  const int act = parse_ffn_activation(std::string(activation));
  std::optional<at::Tensor> index_c;
  int64_t n_rows = num_used;
  if (index.has_value()) {
    index_c = index->contiguous();
    if (check_data) check_ids_below(*index_c, num_used, op, "index", "num_used");
    n_rows = index_c->numel();
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::zeros({x.size(0), d}, xf.options());
  if (x.size(0) > 0 && n_rows > 0 && d > 0)
    launch(xf, n_rows, index_c.has_value() ? index_c->data_ptr<int64_t>() : nullptr, act, y);
  return y.to(x.scalar_type());
}

template <class Launch>
at::Tensor sparse_ffn_gpu_style(const at::Tensor& x, const at::Tensor& matrix, int64_t num_used,
                                const std::optional<at::Tensor>& bias, c10::string_view activation, bool glu,
                                const std::optional<at::Tensor>& index, double threshold, bool check_data,
                                Launch&& launch) {
  const int64_t d = check_sparse_ffn_args(x, matrix, num_used, bias, glu, index, threshold);
  return ffn_rows_gpu_style("sparse_ffn", x, d, num_used, activation, index, check_data, launch);
}

// The contiguous inputs and scratch of a GPU-style quantized_sparse_ffn launch for one call (sizes: the comment of
// launch_quantized_sparse_ffn, csrc/cuda/quantized_sparse_ffn_kernel.cuh).
struct QuantizedFfnCall {
  QuantizedBundle layout;
  at::Tensor matrix, codes, scale, scaled_sum, act_buf, partial;
  std::optional<at::Tensor> bias;  // float32
  const float* bias_ptr() const { return bias.has_value() ? bias->data_ptr<float>() : nullptr; }
};

// launch(const QuantizedFfnCall&, x_f32, n_rows, index or nullptr, act code, y_f32) runs the kernels.
template <class Launch>
at::Tensor quantized_sparse_ffn_gpu_style(const at::Tensor& x, const at::Tensor& matrix, int64_t num_used,
                                          const std::optional<at::Tensor>& bias, c10::string_view activation, bool glu,
                                          const std::string& bundle_format, const std::optional<at::Tensor>& index,
                                          double threshold, bool check_data, Launch&& launch) {
  const QuantizedBundle layout =
      check_quantized_sparse_ffn_args(x, matrix, num_used, bias, glu, bundle_format, index, threshold);
  const int64_t d = x.size(1);
  return ffn_rows_gpu_style("quantized_sparse_ffn", x, d, num_used, activation, index, check_data,
                            [&](const at::Tensor& xf, int64_t n_rows, const int64_t* ids, int act, at::Tensor& y) {
                              const int64_t n_tok = xf.size(0), group = std::min<int64_t>(n_tok, kFfnMaxTokens);
                              const int64_t chunks = ffn_grid(n_rows, d, kQuantizedDownElemBytes).chunks;
                              QuantizedFfnCall call{
                                  layout,
                                  matrix.contiguous(),
                                  at::empty({n_tok, layout.n_blocks * kBlock}, xf.options().dtype(at::kChar)),
                                  at::empty({n_tok, layout.n_blocks}, xf.options()),
                                  at::empty({n_tok, layout.n_blocks}, xf.options()),
                                  at::empty({group * n_rows}, xf.options()),
                                  at::empty({chunks * group * d}, xf.options()),
                                  std::nullopt};
                              if (bias.has_value()) call.bias = bias->to(at::kFloat).contiguous();
                              launch(call, xf, n_rows, ids, act, y);
                            });
}

// launch(sorted rows, c) runs the compaction kernels on the deleted rows sorted ascending (at::sort on their device:
// no copy back); returns the new num_used. Without check_data, rows repeated or outside [0, num_used) leave the cache
// in an unspecified state but are never followed out of bounds (cache_compact_kernel.cuh); how many rows there are is
// metadata, checked always, so the kernels' grid never starts below row 0.
template <class Launch>
int64_t cache_compact_gpu_style(at::Tensor& matrix, at::Tensor& pointer, const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& slot_of, int64_t num_used, const at::Tensor& rows,
                                bool check_data, Launch&& launch) {
  check_cache_compact_args(matrix, pointer, bias, slot_of, num_used, rows);
  const int64_t c = rows.numel();
  if (c == 0) return num_used;
  const at::Tensor sorted = std::get<0>(at::sort(rows.contiguous()));
  if (check_data) {
    check_ids_below(sorted, num_used, "cache_compact", "rows (sorted)", "num_used");
    TORCH_CHECK(c == 1 || !sorted.diff().eq(0).any().item<bool>(), "cache_compact: rows holds a row twice");
    if (slot_of.has_value())
      check_ids_below(pointer.slice(0, 0, num_used), slot_of->numel(), "cache_compact", "pointer", "slot_of.numel()");
  }
  TORCH_CHECK(c <= num_used, "cache_compact: rows holds ", c, " entries but only num_used=", num_used,
              " rows are used");
  launch(sorted.data_ptr<int64_t>(), c);
  return num_used - c;
}

}  // namespace flashllm
