// flashllm::endor_linear on the CPU: y = x W^T (+ bias) straight from an Endor tensor W, never materialising W.
//
// OpenMP over the weight's rows (dynamic chunks: rows differ in density); each row is checked as endor_decompress
// checks it (common/endor_rows.h) before any of its values is read, then its T dot products are computed in one pass
// over its bitmap and values, the T accumulators in registers (tokens in groups of at most 8, common/token_groups.h).
// x is read dense and stays in cache (T x n_cols float32); the weight is read once per token group, compressed.
//
// Per ISA, one step of a row (fp16 and bf16 values widened to fp32, all math in fp32 FMA, except avx512bf16's):
//   avx512bf16 (bf16 values, bf16 x)  32 columns: a whole 32-value load (a masked one near the end of `values`)
//           and vpexpandw as below, then one vdpbf16ps with the 32 bf16 x values: no widening, which is most of the
//           VBMI2 path's work per column on Zen 4. A product of two bf16 is exact in fp32, so only the order of the
//           fp32 sums differs (and denormals, which vdpbf16ps flushes); float32 x keeps the VBMI2 path, as rounding
//           it to bf16 would lose its low bits.
//   avx512vbmi2 (fp16, bf16)  32 columns: masked load of popcount(m) values, vpexpandw by the bitmap word, widen
//           the two halves, FMA with x (64 columns per loop trip). Expanding 16-bit lanes halves the expand count
//           against vexpandps, and widening after the expand needs no per-group realignment of the packed values.
//   avx512  16 columns: masked load of popcount(m) values, widen, vexpandps by the bitmap word, FMA with x
//           (64 columns per loop trip, two accumulators per token to hide the FMA latency)
//   avx2    8 columns: load 8 values, widen, a permutation looked up by the bitmap byte, mask, FMA with x
//   scalar  the set bits of the row (count-trailing-zeros walk), one FMA per value and token
// Masked loads stop at the row's values; whole loads (BF16: 32 values; AVX2: 8) are made only where they stay
// inside `values` (masked loads, or the scalar walk, finish the rest), so no path reads out of bounds.
#include <ATen/ATen.h>
#include <immintrin.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "common/cpu_isa.h"
#include "common/endor_checks.h"
#include "common/endor_report.h"
#include "common/endor_rows.h"
#include "common/simd_float.h"
#include "common/token_groups.h"

// GCC 12's masked-load intrinsics start from _mm512_undefined_*, which -Wall reports as uninitialised use.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace flashllm {
namespace {

using Half = c10::Half;
using BF16 = c10::BFloat16;

// One token group's problem: x [NT, n_cols] float32 contiguous, y [NT, n_rows] float32.
template <class T>
struct LinearProblem {
  const T* values;
  int64_t nnz;
  const uint8_t* bitmap;
  const int64_t* offsets;
  int64_t n_rows, n_cols;
  const float* bias;  // [n_rows] float32, or null
};

// ---------------------------------------------------------------------------------------------- scalar
// dots[t] = sum over the first n_cols columns of w * x[t * x_stride + column].
template <class T, int NT>
void row_dots_scalar(const T* v, const uint8_t* bm, int64_t n_cols, const float* x, int64_t x_stride, float* dots) {
  float acc[NT] = {};
  for_each_set_column(bm, n_cols, [&](int64_t col) {
    const float w = static_cast<float>(*v++);
    for (int t = 0; t < NT; ++t) acc[t] += w * x[t * x_stride + col];
  });
  for (int t = 0; t < NT; ++t) dots[t] = acc[t];
}

// ---------------------------------------------------------------------------------------------- AVX2
#define FLASHLLM_AVX2 __attribute__((target("avx2,fma,f16c,popcnt")))

using simd::hsum_avx2;
using simd::load8_avx2;

// The weights of the 8 columns of one bitmap byte, from the values starting at v (zeros where bits are clear).
template <class T>
FLASHLLM_AVX2 inline __m256 expand8_avx2(const T* v, unsigned byte, const EndorAvx2Tables& tables) {
  const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(tables.perm32[byte].data()));
  const __m256i set =
      _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(byte)), lane_bits), lane_bits);
  return _mm256_and_ps(_mm256_permutevar8x32_ps(load8_avx2(v), perm), _mm256_castsi256_ps(set));
}

template <class T, int NT>
FLASHLLM_AVX2 void row_dots_avx2(const T* v, const uint8_t* bm, int64_t n_cols, const float* x, const T* v_end,
                                 float* dots) {
  const EndorAvx2Tables& tables = endor_avx2_tables();
  __m256 acc0[NT], acc1[NT];
  for (int t = 0; t < NT; ++t) acc0[t] = acc1[t] = _mm256_setzero_ps();
  int64_t c = 0;
  // Two bytes per trip, each reading 8 values: stop where that could pass the end of `values`.
  for (; c + 16 <= n_cols && v + 16 <= v_end; c += 16) {
    const unsigned b0 = bm[c / 8], b1 = bm[c / 8 + 1];
    const __m256 w0 = expand8_avx2(v, b0, tables);
    v += __builtin_popcount(b0);
    const __m256 w1 = expand8_avx2(v, b1, tables);
    v += __builtin_popcount(b1);
    for (int t = 0; t < NT; ++t) {
      acc0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * n_cols + c), acc0[t]);
      acc1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + t * n_cols + c + 8), acc1[t]);
    }
  }
  float tail[NT];
  row_dots_scalar<T, NT>(v, bm + c / 8, n_cols - c, x + c, n_cols, tail);
  for (int t = 0; t < NT; ++t) dots[t] = hsum_avx2(_mm256_add_ps(acc0[t], acc1[t])) + tail[t];
}

// ---------------------------------------------------------------------------------------------- AVX-512
// How far ahead of the values being expanded the AVX-512 loops prefetch (one line per 64 columns, ~64 bytes of fp16
// values at 50% density), values and bitmap alike: the loop body from a DRAM-resident 16384 x 4096 fp16 weight ran
// 1.5-1.6x faster with 2-4 KiB of lookahead than on the hardware prefetcher alone (AMD Zen 4, BENCHMARKS.md,
// Endor section).
constexpr int64_t kPrefetchBytes = 2048;

template <class T>
inline void prefetch_ahead(const T* v, const uint8_t* bm) {
  _mm_prefetch(reinterpret_cast<const char*>(v) + kPrefetchBytes, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(bm) + kPrefetchBytes / 8, _MM_HINT_T0);
}

#define FLASHLLM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c,popcnt")))

// The weights of the 16 columns of bitmap word m, from the values starting at v (zeros where bits are clear); reads
// exactly popcount(m) values. The expand merges into a fresh zero register (simd::fresh_zero_ps) rather than
// zero-masking: AMD Zen 4 makes a zero-masked expand wait for the old value of its destination register, which
// chains every expand of the loop through the one register the compiler picks (measured: 2.4x slower per column).
template <class T>
FLASHLLM_AVX512 inline __m512 expand16_avx512(const T* v, __mmask16 m) {
  const __m512 packed = simd::load16_avx512(v, simd::first_lanes16(__builtin_popcount(m)));
  return _mm512_mask_expand_ps(simd::fresh_zero_ps(), m, packed);
}

// x_stride: the distance between two tokens' rows of x (n_cols, or more where the caller passes a row's tail).
template <class T, int NT>
FLASHLLM_AVX512 void row_dots_avx512(const T* v, const uint8_t* bm, int64_t n_cols, const float* x, int64_t x_stride,
                                     float* dots) {
  __m512 acc0[NT], acc1[NT];
  for (int t = 0; t < NT; ++t) acc0[t] = acc1[t] = _mm512_setzero_ps();
  int64_t c = 0;
  // 64 columns per trip: the four 16-column steps find their values from popcounts of the word's prefixes, which
  // do not depend on each other, so only one popcount per trip is on the loop-carried chain through v.
  for (; c + 64 <= n_cols; c += 64) {
    prefetch_ahead(v, bm + c / 8);
    const uint64_t m = load_word<uint64_t>(bm + c / 8);
    const __m512 w0 = expand16_avx512(v, static_cast<__mmask16>(m));
    const __m512 w1 = expand16_avx512(v + __builtin_popcountll(m & 0xFFFFull), static_cast<__mmask16>(m >> 16));
    const __m512 w2 = expand16_avx512(v + __builtin_popcountll(m & 0xFFFFFFFFull), static_cast<__mmask16>(m >> 32));
    const __m512 w3 = expand16_avx512(v + __builtin_popcountll(m & 0xFFFFFFFFFFFFull), static_cast<__mmask16>(m >> 48));
    v += __builtin_popcountll(m);
    for (int t = 0; t < NT; ++t) {
      const float* xt = x + t * x_stride + c;
      acc0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xt), acc0[t]);
      acc1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xt + 16), acc1[t]);
      acc0[t] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xt + 32), acc0[t]);
      acc1[t] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xt + 48), acc1[t]);
    }
  }
  for (; c < n_cols; c += 16) {  // at most four steps; bits past n_cols are clear (checked), so m needs no mask
    const int64_t left = n_cols - c;
    const __mmask16 keep = left >= 16 ? static_cast<__mmask16>(0xFFFF) : simd::first_lanes16(left);
    const __mmask16 m = static_cast<__mmask16>(load_mask_bytes(bm + c / 8, std::min<int64_t>(2, (left + 7) / 8)));
    const __m512 w = expand16_avx512(v, m);
    v += __builtin_popcount(m);
    for (int t = 0; t < NT; ++t)
      acc0[t] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(keep, x + t * x_stride + c), acc0[t]);
  }
  for (int t = 0; t < NT; ++t) dots[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[t], acc1[t]));
}

// ---------------------------------------------------------------------------------------------- AVX-512 VBMI2
#define FLASHLLM_AVX512_VBMI2 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,fma,f16c,popcnt")))

// The 16-bit weights of the 32 columns of bitmap word m, from the `count` = popcount(m) values starting at v, in
// their lanes (zeros where bits are clear); reads exactly `count` values.
template <class T>
FLASHLLM_AVX512_VBMI2 inline __m512i expand32_vbmi2(const T* v, uint32_t m, int count) {
  const __m512i packed = _mm512_maskz_loadu_epi16(static_cast<__mmask32>((uint64_t{1} << count) - 1), v);
  return _mm512_mask_expand_epi16(simd::fresh_zero_si512(), static_cast<__mmask32>(m), packed);
}

// The 16-bit weights of the 64 columns of bitmap word m, expanded into their lanes: columns [0, 32) in lo, [32, 64) in
// hi. Advances v past the popcount(m) values read. kWholeLoads: where 64 values remain before v_end (the end of
// `values`), both 32-value loads are whole loads, which the expand masks; otherwise (and always without kWholeLoads)
// each load reads exactly its half's values. Whole loads pay only in the BF16 step, which widens nothing: there the
// masked loads' mask arithmetic was ~15% of a step (L2-resident, Zen 4). In the widening VBMI2 step they gained
// nothing and measured 0-7% slower in a noisy A/B.
struct Expanded64 {
  __m512i lo, hi;
};

template <bool kWholeLoads, class T>
FLASHLLM_AVX512_VBMI2 inline Expanded64 expand64_vbmi2(const T*& v, uint64_t m, const T* v_end) {
  const int count_lo = __builtin_popcount(static_cast<uint32_t>(m)), count = __builtin_popcountll(m);
  Expanded64 e;
  if (kWholeLoads && v_end - v >= 64) {
    e.lo = _mm512_mask_expand_epi16(simd::fresh_zero_si512(), static_cast<__mmask32>(m), _mm512_loadu_si512(v));
    e.hi = _mm512_mask_expand_epi16(simd::fresh_zero_si512(), static_cast<__mmask32>(m >> 32),
                                    _mm512_loadu_si512(v + count_lo));
  } else {
    e.lo = expand32_vbmi2(v, static_cast<uint32_t>(m), count_lo);
    e.hi = expand32_vbmi2(v + count_lo, static_cast<uint32_t>(m >> 32), count - count_lo);
  }
  v += count;
  return e;
}

// Lanes [16 * half, 16 * half + 16) of 32 fp16 or bf16 weights as fp32.
template <class T, int half>
FLASHLLM_AVX512_VBMI2 inline __m512 widen16_vbmi2(__m512i w) {
  const __m256i part = _mm512_extracti64x4_epi64(w, half);
  if constexpr (std::is_same_v<T, Half>) {
    return _mm512_cvtph_ps(part);
  } else {
    static_assert(std::is_same_v<T, BF16>);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(part), 16));
  }
}

template <class T, int NT>
FLASHLLM_AVX512_VBMI2 void row_dots_avx512_vbmi2(const T* v, const uint8_t* bm, int64_t n_cols, const float* x,
                                                 float* dots) {
  __m512 acc0[NT], acc1[NT];
  for (int t = 0; t < NT; ++t) acc0[t] = acc1[t] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 64 <= n_cols; c += 64) {
    prefetch_ahead(v, bm + c / 8);
    const Expanded64 e = expand64_vbmi2<false>(v, load_word<uint64_t>(bm + c / 8), v);  // no v_end: exact loads
    const __m512 w0 = widen16_vbmi2<T, 0>(e.lo), w1 = widen16_vbmi2<T, 1>(e.lo);
    const __m512 w2 = widen16_vbmi2<T, 0>(e.hi), w3 = widen16_vbmi2<T, 1>(e.hi);
    for (int t = 0; t < NT; ++t) {
      const float* xt = x + t * n_cols + c;
      acc0[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xt), acc0[t]);
      acc1[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xt + 16), acc1[t]);
      acc0[t] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xt + 32), acc0[t]);
      acc1[t] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xt + 48), acc1[t]);
    }
  }
  float tail[NT];
  row_dots_avx512<T, NT>(v, bm + c / 8, n_cols - c, x + c, n_cols, tail);
  for (int t = 0; t < NT; ++t) dots[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[t], acc1[t])) + tail[t];
}

// ---------------------------------------------------------------------------------------------- AVX-512 BF16
#define FLASHLLM_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,avx512bf16,fma,f16c,popcnt")))

// xb: the NT tokens' rows of x in bf16 [NT, n_cols]; x: the same rows in float32, for the row's tail.
template <int NT>
FLASHLLM_AVX512_BF16 void row_dots_avx512_bf16(const BF16* v, const uint8_t* bm, int64_t n_cols, const BF16* xb,
                                               const float* x, const BF16* v_end, float* dots) {
  __m512 acc0[NT], acc1[NT];
  for (int t = 0; t < NT; ++t) acc0[t] = acc1[t] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 64 <= n_cols; c += 64) {
    prefetch_ahead(v, bm + c / 8);
    const Expanded64 e = expand64_vbmi2<true>(v, load_word<uint64_t>(bm + c / 8), v_end);
    const __m512bh w0 = (__m512bh)e.lo, w1 = (__m512bh)e.hi;
    for (int t = 0; t < NT; ++t) {
      const BF16* xt = xb + t * n_cols + c;
      acc0[t] = _mm512_dpbf16_ps(acc0[t], w0, (__m512bh)_mm512_loadu_si512(xt));
      acc1[t] = _mm512_dpbf16_ps(acc1[t], w1, (__m512bh)_mm512_loadu_si512(xt + 32));
    }
  }
  float tail[NT];
  row_dots_avx512<BF16, NT>(v, bm + c / 8, n_cols - c, x + c, n_cols, tail);
  for (int t = 0; t < NT; ++t) dots[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[t], acc1[t])) + tail[t];
}

// ---------------------------------------------------------------------------------------------- driver
// y[t * n_rows + r] for the NT tokens of x (float32; x_bf16: the same rows in bf16 where x is bf16, else null);
// refused rows are noted in bad_row and left unwritten.
template <class T, int NT>
void linear_group(const LinearProblem<T>& p, const float* x, const BF16* x_bf16, float* y, LowestBadRow& bad_row) {
  const CpuIsa isa = active_cpu_isa();
  const int64_t n_bytes = (p.n_cols + 7) / 8;
  // Waking the thread team costs more than it saves below ~256 KiB of weight.
  const int64_t weight_bytes = p.nnz * static_cast<int64_t>(sizeof(T)) + p.n_rows * n_bytes;
#pragma omp parallel for schedule(dynamic, 16) if (weight_bytes >= (256 << 10))
  for (int64_t r = 0; r < p.n_rows; ++r) {
    int64_t start = 0;
    const int code = endor_row_code(p.bitmap, p.offsets, r, p.n_rows, p.n_cols, p.nnz, &start);
    if (code != kEndorRowOk) {
      bad_row.note(r, code);
      continue;
    }
    const T* v = p.values + start;
    const uint8_t* bm = p.bitmap + r * n_bytes;
    float dots[NT];
    switch (isa) {
      case CpuIsa::kAvx512Bf16:
        if constexpr (std::is_same_v<T, BF16>) {
          if (x_bf16 != nullptr) {
            row_dots_avx512_bf16<NT>(v, bm, p.n_cols, x_bf16, x, p.values + p.nnz, dots);
            break;
          }
        }
        [[fallthrough]];
      case CpuIsa::kAvx512Vbmi2:
        if constexpr (!std::is_same_v<T, float>) {  // fp32 lanes gain nothing from 16-bit expands
          row_dots_avx512_vbmi2<T, NT>(v, bm, p.n_cols, x, dots);
          break;
        }
        [[fallthrough]];
      case CpuIsa::kAvx512Vnni:
      case CpuIsa::kAvx512:
        row_dots_avx512<T, NT>(v, bm, p.n_cols, x, p.n_cols, dots);
        break;
      case CpuIsa::kAvx2:
        row_dots_avx2<T, NT>(v, bm, p.n_cols, x, p.values + p.nnz, dots);
        break;
      default:
        row_dots_scalar<T, NT>(v, bm, p.n_cols, x, p.n_cols, dots);
    }
    const float b = p.bias ? p.bias[r] : 0.f;
    for (int t = 0; t < NT; ++t) y[t * p.n_rows + r] = dots[t] + b;
  }
}

at::Tensor endor_linear_cpu(const at::Tensor& x, const at::Tensor& values_in, const at::Tensor& bitmap_in,
                            const at::Tensor& row_offsets_in, int64_t n_cols, const std::optional<at::Tensor>& bias) {
  const int64_t n_rows = check_endor_linear_args(x, values_in, bitmap_in, row_offsets_in, n_cols, bias);
  const at::Tensor values = values_in.contiguous(), bitmap = bitmap_in.contiguous();
  const at::Tensor offsets = row_offsets_in.contiguous();
  const int64_t nnz = values.numel(), n_tok = x.size(0);
  const int64_t* off = offsets.data_ptr<int64_t>();
  check_endor_offset_ends("endor_linear", off[0], off[n_rows], nnz);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor xb = x.scalar_type() == at::kBFloat16 ? x.contiguous() : at::Tensor();
  const std::optional<at::Tensor> bias_f =
      bias.has_value() ? std::optional<at::Tensor>(bias->to(at::kFloat).contiguous()) : std::nullopt;
  at::Tensor yf = at::empty({n_tok, n_rows}, xf.options());
  LowestBadRow bad_row;
  auto run = [&](auto element) {
    using T = decltype(element);
    const LinearProblem<T> p{values.data_ptr<T>(),
                             nnz,
                             bitmap.data_ptr<uint8_t>(),
                             off,
                             n_rows,
                             n_cols,
                             bias_f ? bias_f->data_ptr<float>() : nullptr};
    for (int64_t t0 = 0; t0 < n_tok && bad_row.packed() == kEndorNoError; t0 += kCpuMaxTokens) {
      const int nt = static_cast<int>(std::min<int64_t>(kCpuMaxTokens, n_tok - t0));
      with_tokens(nt, [&](auto nt_c) {
        linear_group<T, decltype(nt_c)::value>(p, xf.data_ptr<float>() + t0 * n_cols,
                                               xb.defined() ? xb.data_ptr<BF16>() + t0 * n_cols : nullptr,
                                               yf.data_ptr<float>() + t0 * n_rows, bad_row);
      });
    }
  };
  switch (values.scalar_type()) {
    case at::kFloat:
      run(float{});
      break;
    case at::kHalf:
      run(Half{});
      break;
    default:
      run(BF16{});
  }
  throw_if_endor_bad_row("endor_linear", bad_row.packed(), values, bitmap, offsets, n_cols, std::nullopt);
  return yf.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(flashllm, CPU, m) {
  m.impl("endor_linear", &endor_linear_cpu);
}

}  // namespace flashllm
