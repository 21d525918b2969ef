// Float loads, reductions and the row prefetch shared by the CPU kernels' AVX2 and AVX-512 paths (sparse_ffn,
// endor_linear): fp32, fp16 (F16C) and bf16 (the high half of an fp32) widened to fp32 lanes. Each helper is compiled
// with only the features it needs, so kernels compiled with more (FMA, POPCNT, ...) inline it; never call one on a CPU
// the dispatch (common/cpu_isa.h) did not pick that path for.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

namespace flashllm::simd {

// 8 consecutive values as fp32.
template <class T>
__attribute__((target("avx2,f16c"))) inline __m256 load8_avx2(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    static_assert(std::is_same_v<T, c10::BFloat16>);
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
}

__attribute__((target("avx2"))) inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// How far ahead of its loads a kernel streaming rows prefetches: on a 2-vCPU AVX2 EPYC one thread streaming fp16 rows
// went from 12.1 to 14.3 GB/s with it (a plain read: 16.4); the hardware prefetcher alone keeps too few lines in
// flight.
constexpr int64_t kPrefetchBytes = 1024;

// The line kPrefetchBytes past p, into L1; a kernel calls it about once per 64 bytes it streams.
inline void prefetch_ahead(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
}

// The lanes [0, n) of a 16-lane mask, n <= 16.
inline __mmask16 first_lanes16(int64_t n) {
  return static_cast<__mmask16>((1u << n) - 1u);
}

// The 16 values at p whose lanes are set in m, as fp32 (zeros elsewhere); never touches memory of a clear lane.
template <class T>
__attribute__((target("avx512f,avx512bw,avx512vl,f16c"))) inline __m512 load16_avx512(const T* p, __mmask16 m) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(m, p);
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  } else {
    static_assert(std::is_same_v<T, c10::BFloat16>);
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
}

// A zero register no earlier instruction writes, as the merge source of an expand: a zero-masked vexpandps /
// vpexpand{w,d} waits for its destination register's old value on AMD Zen 4 (a false dependency that chains a loop's
// expands), a merge into this register waits for nothing. The asm keeps the compiler from folding the merge back into
// zero-masking; volatile keeps one zeroing per expand.
__attribute__((target("avx512f"))) inline __m512 fresh_zero_ps() {
  __m512 z;
  asm volatile("vpxord %0, %0, %0" : "=v"(z));
  return z;
}

__attribute__((target("avx512f"))) inline __m512i fresh_zero_si512() {
  return _mm512_castps_si512(fresh_zero_ps());
}

}  // namespace flashllm::simd
