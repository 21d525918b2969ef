// flashllm::decode_attention on the CPU: one query token per sequence against S keys/values stored token-major
// ([token][batch x kv head][head_dim], INF²'s on-disk KV block layout), GQA/MQA aware, float32 accumulation.
//
// Work items are (sequence b, kv head g) pairs; the Hq/Hkv query heads of a GQA group are one item, so every K and V
// row is read once. OpenMP threads take contiguous ranges of items and all walk the tokens in chunks of kChunk, the
// item loop inside the chunk loop: at each moment a thread reads kChunk consecutive token rows, each at the bytes
// just past those of its previous item, so the whole block streams through memory in order (a row-per-item sweep
// would touch a new page on every row: the rows of one item lie B x Hkv x D elements apart). Rows a page or more
// apart defeat the hardware prefetchers, so the loop prefetches the next item's rows itself.
// Per item and chunk, the online softmax: scores for the chunk (per ISA), the chunk's max, one rescale of the
// running sum and accumulator when the max grows, exp of the scores (per ISA: a vectorised expf on AVX2/AVX-512,
// glibc's on the scalar path), then acc += p x V (per ISA).
// The running accumulator is the output tensor itself and the running sum is the lse tensor, normalised at the end.
//
// Per ISA (fp16 / bf16 rows widened to fp32 with common/simd_float.h; query heads in register groups of up to 4, so
// one widened K or V vector serves every head of the group):
//   avx512  16 lanes, masked loads for the D % 16 tail
//   avx2    8 lanes, a scalar tail
//   scalar  plain loops
#include <ATen/ATen.h>
#include <immintrin.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "common/cpu_isa.h"
#include "common/decode_attention_checks.h"
#include "common/simd_float.h"
#include "cpu/decode_attention.h"

// GCC 12's masked-load intrinsics start from _mm512_undefined_*, which -Wall reports as uninitialised use.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace flashllm {
namespace {

using Half = c10::Half;
using BF16 = c10::BFloat16;

constexpr int64_t kChunk = 32;  // tokens per online-softmax step: amortises the rescale, keeps rows in L1
constexpr int kHeadGroup = 4;   // query heads whose accumulators share one widened K/V vector

// The kernels of one ISA for a group of NH <= kHeadGroup query heads (one function per NH, so each group's
// accumulators are registers): scores[h * kChunk + t] = q_h . k_t for the heads at q ([NH][D], pre-scaled) and the
// n rows at k (k_row elements apart); acc[h][:] += sum_t p[h * kChunk + t] * v_t for the n rows at v.
template <class T>
using ScoresFn = void (*)(const float* q, int64_t head_dim, const T* k, int64_t k_row, int64_t n, float* scores);
template <class T>
using AccumulateFn = void (*)(const float* p, int64_t head_dim, const T* v, int64_t v_row, int64_t n, float* acc);

// s[t] = exp(s[t] - shift) for t < n, shift >= every s[t] (a running max); returns the sum of the new s[t].
using ExpFn = float (*)(float* s, int64_t n, float shift);

template <class T>
struct IsaKernels {
  ScoresFn<T> scores[kHeadGroup];  // [NH - 1]
  AccumulateFn<T> accumulate[kHeadGroup];
  ExpFn exp_shifted;
};

// ---------------------------------------------------------------------------------------------- scalar
template <class T, int NH>
void scores_scalar(const float* q, int64_t head_dim, const T* k, int64_t k_row, int64_t n, float* scores) {
  for (int64_t t = 0; t < n; ++t) {
    const T* row = k + t * k_row;
    for (int h = 0; h < NH; ++h) {
      float s = 0.f;
      for (int64_t d = 0; d < head_dim; ++d) s += q[h * head_dim + d] * static_cast<float>(row[d]);
      scores[h * kChunk + t] = s;
    }
  }
}

template <class T, int NH>
void accumulate_scalar(const float* p, int64_t head_dim, const T* v, int64_t v_row, int64_t n, float* acc) {
  for (int64_t t = 0; t < n; ++t) {
    const T* row = v + t * v_row;
    for (int64_t d = 0; d < head_dim; ++d) {
      const float x = static_cast<float>(row[d]);
      for (int h = 0; h < NH; ++h) acc[h * head_dim + d] += p[h * kChunk + t] * x;
    }
  }
}

float exp_shifted_scalar(float* s, int64_t n, float shift) {
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) sum += (s[t] = std::exp(s[t] - shift));
  return sum;
}

// The vector paths' exp of x <= 0 (a score minus the running max): Cephes' expf (range reduction by ln 2 in two
// parts, degree-7 polynomial; about 2 ulp), 0 below kExpLow (where expf is denormal or 0; the max's own term is 1),
// NaN kept. The scalar path and the vector tails use glibc's expf.
constexpr float kExpLow = -87.33654f, kLog2e = 1.44269504088896341f, kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// ---------------------------------------------------------------------------------------------- AVX2
#define FLASHLLM_AVX2 __attribute__((target("avx2,fma,f16c")))

FLASHLLM_AVX2 inline __m256 exp_nonpositive_avx2(__m256 x) {
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q), tiny = _mm256_cmp_ps(x, _mm256_set1_ps(kExpLow), _CMP_LT_OQ);
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLow)), _mm256_setzero_ps());
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 y = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kExpPoly[i]));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  // 2^n for n in [-126, 0]: the exponent field directly.
  const __m256 scale =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  const __m256 e = _mm256_andnot_ps(tiny, _mm256_mul_ps(y, scale));
  return _mm256_blendv_ps(e, x, nan);
}

FLASHLLM_AVX2 float exp_shifted_avx2(float* s, int64_t n, float shift) {
  __m256 sum = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(shift)));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  return simd::hsum_avx2(sum) + exp_shifted_scalar(s + t, n - t, shift);
}

template <class T, int NH>
FLASHLLM_AVX2 void scores_avx2(const float* q, int64_t head_dim, const T* k, int64_t k_row, int64_t n, float* scores) {
  const int64_t vec_end = head_dim - head_dim % 8;
  for (int64_t t = 0; t < n; ++t) {
    const T* row = k + t * k_row;
    __m256 acc[NH];
    for (int h = 0; h < NH; ++h) acc[h] = _mm256_setzero_ps();
    for (int64_t d = 0; d < vec_end; d += 8) {
      const __m256 x = simd::load8_avx2(row + d);
      for (int h = 0; h < NH; ++h) acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * head_dim + d), x, acc[h]);
    }
    for (int h = 0; h < NH; ++h) {
      float s = simd::hsum_avx2(acc[h]);
      for (int64_t d = vec_end; d < head_dim; ++d) s += q[h * head_dim + d] * static_cast<float>(row[d]);
      scores[h * kChunk + t] = s;
    }
  }
}

template <class T, int NH>
FLASHLLM_AVX2 void accumulate_avx2(const float* p, int64_t head_dim, const T* v, int64_t v_row, int64_t n, float* acc) {
  const int64_t vec_end = head_dim - head_dim % 8;
  for (int64_t d = 0; d < vec_end; d += 8) {
    __m256 a[NH];
    for (int h = 0; h < NH; ++h) a[h] = _mm256_loadu_ps(acc + h * head_dim + d);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 x = simd::load8_avx2(v + t * v_row + d);
      for (int h = 0; h < NH; ++h) a[h] = _mm256_fmadd_ps(_mm256_set1_ps(p[h * kChunk + t]), x, a[h]);
    }
    for (int h = 0; h < NH; ++h) _mm256_storeu_ps(acc + h * head_dim + d, a[h]);
  }
  for (int64_t t = 0; t < n; ++t)
    for (int64_t d = vec_end; d < head_dim; ++d) {
      const float x = static_cast<float>(v[t * v_row + d]);
      for (int h = 0; h < NH; ++h) acc[h * head_dim + d] += p[h * kChunk + t] * x;
    }
}

// ---------------------------------------------------------------------------------------------- AVX-512
#define FLASHLLM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))

FLASHLLM_AVX512 inline __mmask16 lanes_left(int64_t head_dim, int64_t d) {
  return head_dim - d >= 16 ? static_cast<__mmask16>(0xFFFF) : simd::first_lanes16(head_dim - d);
}

FLASHLLM_AVX512 inline __m512 exp_nonpositive_avx512(__m512 x) {
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpLow), _CMP_LT_OQ);
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpLow)), _mm512_setzero_ps());
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 y = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kExpPoly[i]));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  const __m512 e = _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(y, n));
  return _mm512_mask_mov_ps(e, nan, x);
}

FLASHLLM_AVX512 float exp_shifted_avx512(float* s, int64_t n, float shift) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 m = lanes_left(n, t);
    const __m512 e = exp_nonpositive_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), _mm512_set1_ps(shift)));
    _mm512_mask_storeu_ps(s + t, m, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
  }
  return _mm512_reduce_add_ps(sum);
}

template <class T, int NH>
FLASHLLM_AVX512 void scores_avx512(const float* q, int64_t head_dim, const T* k, int64_t k_row, int64_t n,
                                   float* scores) {
  for (int64_t t = 0; t < n; ++t) {
    const T* row = k + t * k_row;
    // Two accumulators per head (even and odd vectors) halve the FMA dependency chain.
    __m512 a0[NH], a1[NH];
    for (int h = 0; h < NH; ++h) a0[h] = a1[h] = _mm512_setzero_ps();
    int64_t d = 0;
    for (; d + 32 <= head_dim; d += 32) {
      const __m512 x0 = simd::load16_avx512(row + d, 0xFFFF), x1 = simd::load16_avx512(row + d + 16, 0xFFFF);
      for (int h = 0; h < NH; ++h) {
        a0[h] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * head_dim + d), x0, a0[h]);
        a1[h] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * head_dim + d + 16), x1, a1[h]);
      }
    }
    for (; d < head_dim; d += 16) {
      const __mmask16 m = lanes_left(head_dim, d);
      const __m512 x = simd::load16_avx512(row + d, m);
      for (int h = 0; h < NH; ++h) a0[h] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + h * head_dim + d), x, a0[h]);
    }
    for (int h = 0; h < NH; ++h) scores[h * kChunk + t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[h], a1[h]));
  }
}

template <class T, int NH>
FLASHLLM_AVX512 void accumulate_avx512(const float* p, int64_t head_dim, const T* v, int64_t v_row, int64_t n,
                                       float* acc) {
  for (int64_t d = 0; d < head_dim; d += 16) {
    const __mmask16 m = lanes_left(head_dim, d);
    __m512 a[NH];
    for (int h = 0; h < NH; ++h) a[h] = _mm512_maskz_loadu_ps(m, acc + h * head_dim + d);
    for (int64_t t = 0; t < n; ++t) {
      const __m512 x = simd::load16_avx512(v + t * v_row + d, m);
      for (int h = 0; h < NH; ++h) a[h] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * kChunk + t]), x, a[h]);
    }
    for (int h = 0; h < NH; ++h) _mm512_mask_storeu_ps(acc + h * head_dim + d, m, a[h]);
  }
}

template <class T>
IsaKernels<T> isa_kernels(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512Bf16:
    case CpuIsa::kAvx512Vbmi2:
    case CpuIsa::kAvx512Vnni:
    case CpuIsa::kAvx512:
      return {{scores_avx512<T, 1>, scores_avx512<T, 2>, scores_avx512<T, 3>, scores_avx512<T, 4>},
              {accumulate_avx512<T, 1>, accumulate_avx512<T, 2>, accumulate_avx512<T, 3>, accumulate_avx512<T, 4>},
              exp_shifted_avx512};
    case CpuIsa::kAvx2:
      return {{scores_avx2<T, 1>, scores_avx2<T, 2>, scores_avx2<T, 3>, scores_avx2<T, 4>},
              {accumulate_avx2<T, 1>, accumulate_avx2<T, 2>, accumulate_avx2<T, 3>, accumulate_avx2<T, 4>},
              exp_shifted_avx2};
    default:
      return {{scores_scalar<T, 1>, scores_scalar<T, 2>, scores_scalar<T, 3>, scores_scalar<T, 4>},
              {accumulate_scalar<T, 1>, accumulate_scalar<T, 2>, accumulate_scalar<T, 3>, accumulate_scalar<T, 4>},
              exp_shifted_scalar};
  }
}

// ---------------------------------------------------------------------------------------------- driver
template <class T>
struct AttentionProblem {
  AttentionShape shape;
  const float* q;  // [B, Hq, D] float32, contiguous, multiplied by the scale
  const T* k;
  const T* v;
  int64_t k_stride[3], v_stride[3];  // token, sequence, kv head (head_dim is unit-stride)
  float* out;                        // [B, Hq, D]: the running accumulator, zeroed
  float* sum;                        // [B, Hq]: the running softmax denominator, zeroed; the lse at the end
};

// The online-softmax step of one item's heads over a chunk of n scores each: scores become exp(score - new max),
// the running max, sum and accumulator follow.
inline void softmax_step(ExpFn exp_shifted, float* scores, int64_t n_heads, int64_t head_dim, int64_t n, float* run_max,
                         float* run_sum, float* acc) {
  for (int64_t h = 0; h < n_heads; ++h) {
    float* s = scores + h * kChunk;
    float chunk_max = s[0];
    for (int64_t t = 1; t < n; ++t) chunk_max = std::max(chunk_max, s[t]);
    const float old_max = run_max[h], new_max = std::max(old_max, chunk_max);
    const float chunk_sum = exp_shifted(s, n, new_max);
    if (new_max != old_max && old_max != -std::numeric_limits<float>::infinity()) {
      const float alpha = std::exp(old_max - new_max);
      run_sum[h] *= alpha;
      for (int64_t d = 0; d < head_dim; ++d) acc[h * head_dim + d] *= alpha;
    }
    run_sum[h] += chunk_sum;
    run_max[h] = new_max;
  }
}

// Prefetches the n rows (token t0 on) of one item's K or V into L1.
template <class T>
inline void prefetch_rows(const T* base, const int64_t* stride, int64_t n_kv_heads, int64_t t0, int64_t n, int64_t item,
                          int64_t head_dim) {
  const char* row = reinterpret_cast<const char*>(base + t0 * stride[0] + item / n_kv_heads * stride[1] +
                                                  item % n_kv_heads * stride[2]);
  const int64_t row_bytes = head_dim * int64_t(sizeof(T)), step = stride[0] * int64_t(sizeof(T));
  for (int64_t t = 0; t < n; ++t, row += step) {
    for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(row + byte);
    __builtin_prefetch(row + row_bytes - 1);  // the line a row not aligned to 64 bytes ends in
  }
}

template <class T>
void attend(const AttentionProblem<T>& p) {
  const IsaKernels<T> kernels = isa_kernels<T>(active_cpu_isa());
  const AttentionShape& s = p.shape;
  const int64_t group = s.group(), n_items = s.batch * s.n_kv_heads, D = s.head_dim;
  std::vector<float> run_max(s.batch * s.n_q_heads, -std::numeric_limits<float>::infinity());
  // Waking the thread team costs more than it saves below ~256 KiB of K and V.
  const bool parallel = 2 * s.seq * n_items * D * int64_t(sizeof(T)) >= (256 << 10) && n_items > 1;
#pragma omp parallel if (parallel)
  {
    const int64_t n_threads = omp_get_num_threads(), thread = omp_get_thread_num();
    const int64_t first = n_items * thread / n_threads, last = n_items * (thread + 1) / n_threads;
    std::vector<float> scores(group * kChunk);
    for (int64_t t0 = 0; t0 < s.seq; t0 += kChunk) {
      const int64_t n = std::min(kChunk, s.seq - t0);
      for (int64_t item = first; item < last; ++item) {
        const int64_t b = item / s.n_kv_heads, g = item % s.n_kv_heads, head = b * s.n_q_heads + g * group;
        const T* k = p.k + t0 * p.k_stride[0] + b * p.k_stride[1] + g * p.k_stride[2];
        const T* v = p.v + t0 * p.v_stride[0] + b * p.v_stride[1] + g * p.v_stride[2];
        // The rows lie a page or more apart, where hardware prefetchers stop: fetch the next item's (or the next
        // chunk's first item's) rows while this item computes.
        if (item + 1 < last) {
          prefetch_rows(p.k, p.k_stride, s.n_kv_heads, t0, n, item + 1, D);
          prefetch_rows(p.v, p.v_stride, s.n_kv_heads, t0, n, item + 1, D);
        } else if (t0 + kChunk < s.seq) {
          const int64_t next_n = std::min(kChunk, s.seq - t0 - kChunk);
          prefetch_rows(p.k, p.k_stride, s.n_kv_heads, t0 + kChunk, next_n, first, D);
          prefetch_rows(p.v, p.v_stride, s.n_kv_heads, t0 + kChunk, next_n, first, D);
        }
        float* acc = p.out + head * D;
        for (int64_t h0 = 0; h0 < group; h0 += kHeadGroup)
          kernels.scores[std::min<int64_t>(kHeadGroup, group - h0) - 1](p.q + (head + h0) * D, D, k, p.k_stride[0], n,
                                                                        scores.data() + h0 * kChunk);
        softmax_step(kernels.exp_shifted, scores.data(), group, D, n, run_max.data() + head, p.sum + head, acc);
        for (int64_t h0 = 0; h0 < group; h0 += kHeadGroup)
          kernels.accumulate[std::min<int64_t>(kHeadGroup, group - h0) - 1](scores.data() + h0 * kChunk, D, v,
                                                                            p.v_stride[0], n, acc + h0 * D);
      }
    }
    for (int64_t head = first * group; head < last * group; ++head) {
      const float sum = p.sum[head];
      const float inv = sum == 0.f ? 0.f : 1.f / sum;  // S = 0: out stays 0; a NaN sum stays NaN
      for (int64_t d = 0; d < D; ++d) p.out[head * D + d] *= inv;
      p.sum[head] = run_max[head] + std::log(sum);  // S = 0: -inf + log 0 = -inf
    }
  }
}

}  // namespace

void decode_attention_scaled(const AttentionShape& shape, const float* q, const at::Tensor& k_in,
                             const at::Tensor& v_in, float* out, float* lse) {
  const at::Tensor k = with_unit_inner_stride(k_in), v = with_unit_inner_stride(v_in);
  std::fill_n(out, shape.batch * shape.n_q_heads * shape.head_dim, 0.f);
  std::fill_n(lse, shape.batch * shape.n_q_heads, 0.f);
  auto run = [&](auto element) {
    using T = decltype(element);
    attend(AttentionProblem<T>{shape,
                               q,
                               static_cast<const T*>(k.data_ptr()),
                               static_cast<const T*>(v.data_ptr()),
                               {k.stride(0), k.stride(1), k.stride(2)},
                               {v.stride(0), v.stride(1), v.stride(2)},
                               out,
                               lse});
  };
  switch (k.scalar_type()) {
    case at::kFloat:
      run(float{});
      break;
    case at::kHalf:
      run(Half{});
      break;
    default:
      run(BF16{});
  }
}

namespace {

std::tuple<at::Tensor, at::Tensor> decode_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                        std::optional<double> scale_in) {
  double scale = 0;
  const AttentionShape shape = check_decode_attention_args(q, k, v, scale_in, &scale);
  const at::Tensor qf = q.to(at::kFloat).mul(scale).contiguous();
  at::Tensor out = at::empty({shape.batch, shape.n_q_heads, shape.head_dim}, qf.options());
  at::Tensor lse = at::empty({shape.batch, shape.n_q_heads}, qf.options());
  decode_attention_scaled(shape, qf.data_ptr<float>(), k, v, out.data_ptr<float>(), lse.data_ptr<float>());
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashllm, CPU, m) {
  m.impl("decode_attention", &decode_attention_cpu);
}

}  // namespace flashllm
