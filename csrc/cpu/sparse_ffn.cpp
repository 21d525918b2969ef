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
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/cpu_isa.h"
#include "common/ffn_rows.h"
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
    // as the dot products prefetch theirs: the lines ahead are the next row's up column
    if ((c * int64_t(sizeof(T))) % 64 == 0) simd::prefetch_ahead(row + c);
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
// The rows of a float bundle matrix for accumulate_ffn_rows (common/ffn_rows.h), with one ISA's row functions.
template <class T, int NT>
struct FloatRows {
  const T* matrix;
  const T* bias_rows;  // per row, or null
  const float* x;      // [NT, d] fp32
  int64_t d, width;
  void (*dots_fn)(const T*, const float*, int64_t, float*);
  void (*axpy_fn)(const T*, const float*, float*, int64_t);

  void prefetch(int64_t r) const { __builtin_prefetch(matrix + r * width); }
  void dots(int64_t r, int part, float* out) const { dots_fn(matrix + r * width + part * d, x, d, out); }
  void axpy(int64_t r, const float* h, float* acc) const { axpy_fn(matrix + r * width + width - d, h, acc, d); }
  float bias(int64_t r) const { return bias_rows ? to_float(bias_rows[r]) : 0.f; }
};

template <class T, int NT>
FloatRows<T, NT> float_rows(CpuIsa isa) {
  FloatRows<T, NT> rows{};
  if (isa >= CpuIsa::kAvx512) {
    rows.dots_fn = &dots_avx512<T, NT>;
    rows.axpy_fn = &axpy_avx512<T, NT>;
  } else if (isa == CpuIsa::kAvx2) {
    rows.dots_fn = &dots_avx2<T, NT>;
    rows.axpy_fn = &axpy_avx2<T, NT>;
  } else {
    rows.dots_fn = &dots_scalar<T, NT>;
    rows.axpy_fn = &axpy_scalar<T, NT>;
  }
  return rows;
}

template <class T>
void sparse_ffn_typed(const at::Tensor& x, const at::Tensor& matrix, int64_t n_rows, const at::Tensor* bias,
                      const int64_t* index, int act, bool glu, float threshold, at::Tensor& out) {
  const int64_t n_tok = x.size(0), d = x.size(1), width = matrix.size(1);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor yf = at::empty({n_tok, d}, x.options().dtype(at::kFloat));
  // Waking the thread team costs more than it saves below ~256 KiB of rows.
  const bool parallel = n_rows * width * static_cast<int64_t>(sizeof(T)) >= (256 << 10);
  for (int64_t t0 = 0; t0 < n_tok; t0 += kCpuMaxTokens) {
    const int nt = static_cast<int>(std::min<int64_t>(kCpuMaxTokens, n_tok - t0));
    float* y = yf.data_ptr<float>() + t0 * d;
    with_tokens(nt, [&](auto nt_c) {
      constexpr int NT = decltype(nt_c)::value;
      FloatRows<T, NT> rows = float_rows<T, NT>(active_cpu_isa());
      rows.matrix = matrix.data_ptr<T>();
      rows.bias_rows = bias ? bias->data_ptr<T>() : nullptr;
      rows.x = xf.data_ptr<float>() + t0 * d;
      rows.d = d;
      rows.width = width;
      sum_row_chunks(n_rows, NT * d, parallel, y, [&](int64_t begin, int64_t end, float* acc) {
        accumulate_ffn_rows<NT>(rows, index, begin, end, act, glu, threshold, acc);
      });
    });
  }
  out.copy_(yf);
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
    n_rows = index_c.numel();
    sorted_index = rows_in_address_order("sparse_ffn", index_c.data_ptr<int64_t>(), n_rows, num_used);
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
