// The dot products of one weight row (fp32, fp16 or bf16, widened to fp32) with NT <= 8 fp32 tokens x [NT, d]
// (token t at x + t * d), one pass over the row, per ISA: the inner loop of sparse_ffn (a bundle's up and gate
// columns) and of half_linear (a weight row). All math in fp32 FMA; call a path only where the runtime dispatch
// (common/cpu_isa.h) picked it.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "common/simd_float.h"

// GCC 12's masked-load intrinsics start from _mm512_undefined_*, which -Wall reports as uninitialised use.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace flashllm::row_dots {

// ---------------------------------------------------------------------------------------------- scalar
template <class T>
inline float to_float(T v) {
  return static_cast<float>(v);
}

template <class T, int NT>
void dots_scalar(const T* col, const float* x, int64_t d, float* dots) {
  float acc[NT] = {};
  for (int64_t c = 0; c < d; ++c) {
    const float w = to_float(col[c]);
    for (int t = 0; t < NT; ++t) acc[t] += w * x[t * d + c];
  }
  for (int t = 0; t < NT; ++t) dots[t] = acc[t];
}

// ---------------------------------------------------------------------------------------------- AVX2
#define FLASHLLM_AVX2 __attribute__((target("avx2,fma,f16c")))

using simd::hsum_avx2;
using simd::load8_avx2;

using simd::prefetch_ahead;

// U independent accumulators per token (4 / NT, at least one) hide the FMA latency when there are few tokens: with one
// chain a decode token (NT = 1) is bound by it at ~10 GB/s of fp16 weights.
template <class T, int NT>
FLASHLLM_AVX2 void dots_avx2(const T* col, const float* x, int64_t d, float* dots) {
  constexpr int U = NT >= 4 ? 1 : 4 / NT;
  constexpr int64_t step = 8 * U, step_bytes = step * sizeof(T);
  const char* bytes = reinterpret_cast<const char*>(col);
  __m256 acc[NT][U];
  for (int t = 0; t < NT; ++t)
    for (int u = 0; u < U; ++u) acc[t][u] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + step <= d; c += step) {
    if constexpr (step_bytes >= 64) {
      for (int64_t b = 0; b < step_bytes; b += 64) prefetch_ahead(bytes + c * sizeof(T) + b);
    } else if ((c * sizeof(T)) % 64 == 0) {
      prefetch_ahead(bytes + c * sizeof(T));
    }
    for (int u = 0; u < U; ++u) {
      const __m256 w = load8_avx2(col + c + 8 * u);
      for (int t = 0; t < NT; ++t) acc[t][u] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + t * d + c + 8 * u), acc[t][u]);
    }
  }
  for (; c + 8 <= d; c += 8) {
    const __m256 w = load8_avx2(col + c);
    for (int t = 0; t < NT; ++t) acc[t][0] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + t * d + c), acc[t][0]);
  }
  for (int t = 0; t < NT; ++t) {
    for (int u = 1; u < U; ++u) acc[t][0] = _mm256_add_ps(acc[t][0], acc[t][u]);
    dots[t] = hsum_avx2(acc[t][0]);
  }
  for (; c < d; ++c) {
    const float w = to_float(col[c]);
    for (int t = 0; t < NT; ++t) dots[t] += w * x[t * d + c];
  }
}

// ---------------------------------------------------------------------------------------------- AVX-512
#define FLASHLLM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))

using simd::load16_avx512;
constexpr auto tail_mask = simd::first_lanes16;

// Two accumulators per token hide the FMA latency when there are few tokens (T = 1 is the decoding case).
template <class T, int NT>
FLASHLLM_AVX512 void dots_avx512(const T* col, const float* x, int64_t d, float* dots) {
  __m512 acc0[NT], acc1[NT];
  for (int t = 0; t < NT; ++t) acc0[t] = acc1[t] = _mm512_setzero_ps();
  const __mmask16 all = 0xFFFF;
  int64_t c = 0;
  for (; c + 32 <= d; c += 32) {
    const __m512 w0 = load16_avx512(col + c, all), w1 = load16_avx512(col + c + 16, all);
    for (int t = 0; t < NT; ++t) {
      acc0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + t * d + c), acc0[t]);
      acc1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + t * d + c + 16), acc1[t]);
    }
  }
  for (; c < d; c += 16) {
    const __mmask16 m = d - c >= 16 ? all : tail_mask(d - c);
    const __m512 w = load16_avx512(col + c, m);
    for (int t = 0; t < NT; ++t) acc0[t] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, x + t * d + c), acc0[t]);
  }
  for (int t = 0; t < NT; ++t) dots[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[t], acc1[t]));
}

}  // namespace flashllm::row_dots
