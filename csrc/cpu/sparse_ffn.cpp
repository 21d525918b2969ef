// flashllm::sparse_ffn on the CPU.
//
// Rows of the cached bundle matrix are split across OpenMP threads (static chunks: every row costs the same);
// each thread accumulates its rows' contributions for every token into its own float32 [T, d] buffer, and the
// buffers are summed into the output at the end. Per row: the dot products of the row's input column(s) with
// the T tokens (one pass over the column, T accumulators), the activation, then one axpy pass over the down row
// for all T tokens; a row whose activations are all exact zeros (ReLU) never reads its up row, and one whose
// every term h (activation, times x.up for GLU) is at or below the threshold never reads its down row.
//
// Per ISA, one step of a dot product or axpy (fp16 and bf16 are widened to fp32, all math in fp32 FMA):
//   avx512  16 elements, masked loads/stores for the row tail
//   avx2    8 elements (F16C for fp16), scalar tail
//   scalar  one element
// Tokens are processed in groups of at most 8, the register budget of the accumulators.
#include <ATen/ATen.h>
#include <immintrin.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/cpu_isa.h"
#include "common/row_dots.h"
#include "common/sparse_ffn_checks.h"
#include "common/token_groups.h"

namespace flashllm {
namespace {

using namespace row_dots;  // to_float, dots_*, the ISA target macros

using Half = c10::Half;
using BF16 = c10::BFloat16;

// ---------------------------------------------------------------------------------------------- scalar
template <class T, int NT>
void axpy_scalar(const T* row, const float* h, float* acc, int64_t d) {
  for (int64_t c = 0; c < d; ++c) {
    const float w = to_float(row[c]);
    for (int t = 0; t < NT; ++t) acc[t * d + c] += h[t] * w;
  }
}

// ---------------------------------------------------------------------------------------------- AVX2
template <class T, int NT>
FLASHLLM_AVX2 void axpy_avx2(const T* row, const float* h, float* acc, int64_t d) {
  __m256 hv[NT];
  for (int t = 0; t < NT; ++t) hv[t] = _mm256_set1_ps(h[t]);
  int64_t c = 0;
  for (; c + 8 <= d; c += 8) {
    const __m256 w = load8_avx2(row + c);
    for (int t = 0; t < NT; ++t) {
      float* y = acc + t * d + c;
      _mm256_storeu_ps(y, _mm256_fmadd_ps(hv[t], w, _mm256_loadu_ps(y)));
    }
  }
  for (; c < d; ++c) {
    const float w = to_float(row[c]);
    for (int t = 0; t < NT; ++t) acc[t * d + c] += h[t] * w;
  }
}

// ---------------------------------------------------------------------------------------------- AVX-512
template <class T, int NT>
FLASHLLM_AVX512 void axpy_avx512(const T* row, const float* h, float* acc, int64_t d) {
  __m512 hv[NT];
  for (int t = 0; t < NT; ++t) hv[t] = _mm512_set1_ps(h[t]);
  for (int64_t c = 0; c < d; c += 16) {
    const __mmask16 m = d - c >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(d - c);
    const __m512 w = load16_avx512(row + c, m);
    for (int t = 0; t < NT; ++t) {
      float* y = acc + t * d + c;
      _mm512_mask_storeu_ps(y, m, _mm512_fmadd_ps(hv[t], w, _mm512_maskz_loadu_ps(m, y)));
    }
  }
}

// ---------------------------------------------------------------------------------------------- driver
inline float activate(float v, int act) {
  switch (act) {
    case kActRelu:
      return v > 0.f ? v : 0.f;
    case kActSilu:
      return v / (1.f + std::exp(-v));
    default:
      return 0.5f * v * (1.f + std::erf(v * 0.70710678118654752f));
  }
}

template <class T>
struct FfnProblem {
  const float* x;  // [n_tok, d] fp32, this token group
  const T* matrix;
  const T* bias;         // per row, or null
  const int64_t* index;  // rows to use, or null: rows [0, n_rows)
  int64_t n_rows, d, width;
  int act;
  bool glu;
  float threshold;
};

// The per-ISA pair of row functions for NT tokens.
template <class T, int NT>
struct RowOps {
  void (*dots)(const T*, const float*, int64_t, float*);
  void (*axpy)(const T*, const float*, float*, int64_t);
};

template <class T, int NT>
RowOps<T, NT> row_ops(CpuIsa isa) {
  if (isa >= CpuIsa::kAvx512) return {&dots_avx512<T, NT>, &axpy_avx512<T, NT>};
  if (isa == CpuIsa::kAvx2) return {&dots_avx2<T, NT>, &axpy_avx2<T, NT>};
  return {&dots_scalar<T, NT>, &axpy_scalar<T, NT>};
}

// Adds rows [begin, end) of the problem into acc [NT, d].
template <class T, int NT>
void accumulate_rows(const FfnProblem<T>& p, RowOps<T, NT> ops, int64_t begin, int64_t end, float* acc) {
  const int64_t d = p.d;
  // Only ReLU makes exact zeros, so only with ReLU can the gate's dot product spare the up column's read. Otherwise
  // the up column is read first and a row is read in address order [up, gate, down]: gate first made every row
  // jump back 2 d bytes, which the hardware prefetchers do not follow (default-model shapes, rows [0, num_used):
  // 1.65x faster this way).
  const bool up_first = p.glu && p.act != kActRelu;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t r = p.index ? p.index[i] : i;
    const T* row = p.matrix + r * p.width;
    if (p.index && i + 1 < end) __builtin_prefetch(p.matrix + p.index[i + 1] * p.width);
    float h[NT], up[NT];
    if (up_first) ops.dots(row, p.x, d, up);
    ops.dots(p.glu ? row + d : row, p.x, d, h);  // the activation's input column: gate for GLU, up otherwise
    const float b = p.bias ? to_float(p.bias[r]) : 0.f;
    bool any = false;
    for (int t = 0; t < NT; ++t) {
      h[t] = activate(h[t] + b, p.act);
      any |= h[t] != 0.f;
    }
    if (!any) continue;  // exact zeros (ReLU) contribute nothing: skip the reads of the up and down rows
    if (p.glu) {
      if (!up_first) ops.dots(row, p.x, d, up);
      for (int t = 0; t < NT; ++t) h[t] *= up[t];
    }
    any = false;
    for (int t = 0; t < NT; ++t) {  // the active-neuron rule: |h| > threshold, h = act (times x.up for GLU)
      h[t] = std::fabs(h[t]) > p.threshold ? h[t] : 0.f;
      any |= h[t] != 0.f;
    }
    if (!any) continue;  // every token's term is below the threshold: skip the read of the down row
    ops.axpy(row + (p.glu ? 2 : 1) * d, h, acc, d);
  }
}

// y [nt, d] = the problem's rows for nt tokens. Threads own row chunks and their own accumulator.
template <class T, int NT>
void run_group(const FfnProblem<T>& p, float* y) {
  const RowOps<T, NT> ops = row_ops<T, NT>(active_cpu_isa());
  const int64_t span = NT * p.d;
  // Waking the thread team costs more than it saves below ~256 KiB of rows.
  const bool parallel = p.n_rows * p.width * static_cast<int64_t>(sizeof(T)) >= (256 << 10);
  const int n_threads = parallel ? omp_get_max_threads() : 1;
  if (n_threads == 1) {
    std::fill(y, y + span, 0.f);
    accumulate_rows<T, NT>(p, ops, 0, p.n_rows, y);
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
    const int64_t chunk = (p.n_rows + omp_get_num_threads() - 1) / omp_get_num_threads();
    float* acc = partial.data() + tid * span;
    std::fill(acc, acc + span, 0.f);
    const int64_t begin = std::min<int64_t>(p.n_rows, tid * chunk);
    accumulate_rows<T, NT>(p, ops, begin, std::min<int64_t>(p.n_rows, begin + chunk), acc);
  }
  std::copy(partial.begin(), partial.begin() + span, y);
  for (int k = 1; k < team; ++k) {
    const float* acc = partial.data() + k * span;
    for (int64_t c = 0; c < span; ++c) y[c] += acc[c];
  }
}

template <class T>
void sparse_ffn_typed(const at::Tensor& x, const at::Tensor& matrix, int64_t n_rows, const at::Tensor* bias,
                      const int64_t* index, int act, bool glu, float threshold, at::Tensor& out) {
  const int64_t n_tok = x.size(0), d = x.size(1);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor yf = at::empty({n_tok, d}, x.options().dtype(at::kFloat));
  FfnProblem<T> p{
      nullptr,  matrix.data_ptr<T>(), bias ? bias->data_ptr<T>() : nullptr, index, n_rows, d, matrix.size(1), act, glu,
      threshold};
  for (int64_t t0 = 0; t0 < n_tok; t0 += kCpuMaxTokens) {
    const int nt = static_cast<int>(std::min<int64_t>(kCpuMaxTokens, n_tok - t0));
    p.x = xf.data_ptr<float>() + t0 * d;
    float* y = yf.data_ptr<float>() + t0 * d;
    with_tokens(nt, [&](auto nt_c) { run_group<T, decltype(nt_c)::value>(p, y); });
  }
  out.copy_(yf);
}

// The rows of `index` (repeats kept: each counts) in ascending order: by counting, O(n + num_used), unless the index
// is a small part of the rows (a comparison sort then costs less than a pass over num_used counters). The sum is
// over the same rows in another order. A cache's slots come in no order, and rows visited out of address order are
// slower than the same rows in order (default-model shapes, 75% of a cache's rows: 1.3x), as the hardware
// prefetchers fetch the rows after each one whether or not they come next.
std::vector<int64_t> rows_in_address_order(const int64_t* ids, int64_t n, int64_t num_used) {
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

at::Tensor sparse_ffn_cpu(const at::Tensor& x, const at::Tensor& matrix, int64_t num_used,
                          const std::optional<at::Tensor>& bias, c10::string_view activation, bool glu,
                          const std::optional<at::Tensor>& index, double threshold) {
  check_sparse_ffn_args(x, matrix, num_used, bias, glu, index, threshold);
  const int act = parse_ffn_activation(std::string(activation));
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  std::vector<int64_t> sorted_index;
  int64_t n_rows = num_used;
  if (index.has_value()) {
    const at::Tensor index_c = index->contiguous();
    const int64_t* ids = index_c.data_ptr<int64_t>();
    n_rows = index_c.numel();
    for (int64_t i = 0; i < n_rows; ++i)
      TORCH_CHECK(ids[i] >= 0 && ids[i] < num_used, "sparse_ffn: index[", i, "]=", ids[i],
                  " is outside [0, num_used=", num_used, ")");
    sorted_index = rows_in_address_order(ids, n_rows, num_used);
  }
  const std::optional<at::Tensor> bias_c = bias.has_value() ? std::optional<at::Tensor>(bias->contiguous()) : bias;
  const at::Tensor* bias_ptr = bias_c.has_value() ? &*bias_c : nullptr;
  const int64_t* ids = index.has_value() ? sorted_index.data() : nullptr;
  if (x.size(0) == 0) return out;
  switch (x.scalar_type()) {
    case at::kFloat:
      sparse_ffn_typed<float>(x, matrix, n_rows, bias_ptr, ids, act, glu, float(threshold), out);
      break;
    case at::kHalf:
      sparse_ffn_typed<Half>(x, matrix, n_rows, bias_ptr, ids, act, glu, float(threshold), out);
      break;
    default:
      sparse_ffn_typed<BF16>(x, matrix, n_rows, bias_ptr, ids, act, glu, float(threshold), out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(flashllm, CPU, m) {
  m.impl("sparse_ffn", &sparse_ffn_cpu);
}

}  // namespace flashllm
