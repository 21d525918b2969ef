// The row loop of the CPU sparse FFN kernels (sparse_ffn over float bundles, quantized_sparse_ffn over quantized
// ones): which rows, in which order, over which threads, and per row the activation, the skips and the threshold.
// A kernel supplies only how a row's dot products and down-row axpy are computed, as a `Rows` type with
//   void prefetch(int64_t r) const;                       // row r comes next
//   void dots(int64_t r, int part, float* out) const;     // out[t] = x_t . input column `part` (0 up, 1 gate) of r
//   void axpy(int64_t r, const float* h, float* acc) const;  // acc[t * d + c] += h[t] * down_r[c]
//   float bias(int64_t r) const;                          // r's input bias (0 without one)
#pragma once
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/sparse_ffn_checks.h"

namespace flashllm {

inline float ffn_activate(float v, int act) {
  switch (act) {
    case kActRelu:
      return v < 0.f ? 0.f : v;  // NaN stays NaN, as torch's relu
    case kActSilu:
      return v / (1.f + std::exp(-v));
    case kActGelu:
      return 0.5f * v * (1.f + std::erf(v * 0.70710678118654752f));
    default:  // kActGeluTanh: sqrt(2 / pi) (v + 0.044715 v^3)
      return 0.5f * v * (1.f + std::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v)));
  }
}

// Adds rows [begin, end) (of `index`, or rows begin..end-1 without one) into acc [NT, d].
template <int NT, class Rows>
void accumulate_ffn_rows(const Rows& rows, const int64_t* index, int64_t begin, int64_t end, int act, bool glu,
                         float threshold, float* acc) {
  // Only ReLU makes exact zeros, so only with ReLU can the gate's dot product spare the up column's read. Otherwise
  // the up column is read first and a row is read in address order [up, gate, down]: gate first made every row
  // jump back 2 d bytes, which the hardware prefetchers do not follow (default-model shapes, rows [0, num_used):
  // 1.65x faster this way).
  const bool up_first = glu && act != kActRelu;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t r = index ? index[i] : i;
    if (index && i + 1 < end) rows.prefetch(index[i + 1]);
    float h[NT], up[NT];
    if (up_first) rows.dots(r, 0, up);
    rows.dots(r, glu ? 1 : 0, h);  // the activation's input column: gate for GLU, up otherwise
    const float b = rows.bias(r);
    bool any = false;
    for (int t = 0; t < NT; ++t) {
      h[t] = ffn_activate(h[t] + b, act);
      any |= h[t] != 0.f;
    }
    if (!any) continue;  // exact zeros (ReLU) contribute nothing: skip the reads of the up and down rows
    if (glu) {
      if (!up_first) rows.dots(r, 0, up);
      for (int t = 0; t < NT; ++t) h[t] *= up[t];
    }
    any = false;
    // the active-neuron rule: |h| > threshold, h = act (times x.up for GLU); a NaN stays (never silently dropped)
    for (int t = 0; t < NT; ++t) {
      h[t] = std::fabs(h[t]) <= threshold ? 0.f : h[t];
      any |= h[t] != 0.f;
    }
    if (!any) continue;  // every token's term is below the threshold: skip the read of the down row
    rows.axpy(r, h, acc);
  }
}

// y [span] = the sum over rows [0, n_rows) of what accumulate(begin, end, acc) adds into a zeroed acc [span]:
// threads own row chunks (static: every row costs the same) and their own accumulator when `parallel`.
template <class Accumulate>
void sum_row_chunks(int64_t n_rows, int64_t span, bool parallel, float* y, Accumulate&& accumulate) {
  const int n_threads = parallel ? omp_get_max_threads() : 1;
  if (n_threads == 1) {
    std::fill(y, y + span, 0.f);
    accumulate(int64_t{0}, n_rows, y);
    return;
  }
  std::vector<float> partial(static_cast<size_t>(n_threads) * span);
  int team = 1;
  // One barrier per call (the region's end): on a shared, oversubscribed machine every barrier waits for the
  // slowest thread, so the final reduction (n_threads x T x d floats, tiny) runs on the calling thread after it.
#pragma omp parallel num_threads(n_threads)
  {
    const int tid = omp_get_thread_num();
#pragma omp single nowait
    team = omp_get_num_threads();
    const int64_t chunk = (n_rows + omp_get_num_threads() - 1) / omp_get_num_threads();
    float* acc = partial.data() + tid * span;
    std::fill(acc, acc + span, 0.f);
    const int64_t begin = std::min<int64_t>(n_rows, tid * chunk);
    accumulate(begin, std::min<int64_t>(n_rows, begin + chunk), acc);
  }
  std::copy(partial.begin(), partial.begin() + span, y);
  for (int k = 1; k < team; ++k) {
    const float* acc = partial.data() + k * span;
    for (int64_t c = 0; c < span; ++c) y[c] += acc[c];
  }
}

// The rows of `index` (repeats kept: each counts) in ascending order: by counting, O(n + num_used), unless the index
// is a small part of the rows (a comparison sort then costs less than a pass over num_used counters). The sum is
// over the same rows in another order. A cache's slots come in no order, and rows visited out of address order are
// slower than the same rows in order (default-model shapes, 75% of a cache's rows: 1.3x), as the hardware
// prefetchers fetch the rows after each one whether or not they come next. Raises on an entry outside
// [0, num_used), naming the op.
inline std::vector<int64_t> rows_in_address_order(const char* op, const int64_t* ids, int64_t n, int64_t num_used) {
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < num_used, op, ": index[", i, "]=", ids[i],
                " is outside [0, num_used=", num_used, ")");
  if (n * 16 < num_used) {
    std::vector<int64_t> out(ids, ids + n);
    std::sort(out.begin(), out.end());
    return out;
  }
  std::vector<int32_t> count(num_used, 0);
  for (int64_t i = 0; i < n; ++i) ++count[ids[i]];
  std::vector<int64_t> out;
  out.reserve(n);
  for (int64_t r = 0; r < num_used; ++r)
    for (int32_t k = 0; k < count[r]; ++k) out.push_back(r);
  return out;
}

}  // namespace flashllm
