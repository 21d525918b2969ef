// flashllm::quantized_sparse_ffn on the CPU: sparse_ffn over bundle rows of GGUF blocks (Q8_0, Q4_0, Q4_1:
// common/quantized_ffn_checks.h), never dequantising an input column.
//
// Each token is first quantized per block of 32 columns (int8 codes, a float32 scale s and s * sum(codes): the op's
// contract, flashllm_ext/ops/blocks.py: quantize_x_blocks), so a column's dot product with a token is, per block b,
// an integer sum of its codes times the token's codes:
//   x . w = sum_b  d_b * s_b * isum_b  +  c_b * (s_b * sum(codes_b))
// where isum_b sums the weight codes u as the path holds them and c_b corrects for how: Q4_0's nibbles n (w = d (n - 8):
// c = -8 d), Q4_1's (w = d n + m: c = m), Q8_0's signed codes q (as they are: c = 0; or, VNNI, q + 128 unsigned:
// c = -128 d). The down row is dequantized a block at a time and added into the output as in sparse_ffn.
// Per ISA (common/cpu_isa.h), a block's integer sum for each of up to 8 tokens:
//   avx512_vnni  vpdpbusd: 32 unsigned codes x 32 int8 codes into 8 int32 lanes, one instruction
//   avx2         vpmaddubsw + vpmaddwd (Q8_0: |q| times x with q's sign, so the int16 pairs cannot saturate)
//   scalar       integer loop
// and the down row's blocks are widened to fp32 16 (AVX-512 levels) or 8 (AVX2) lanes at a time. The row loop,
// threads and skips are sparse_ffn's (common/ffn_rows.h).
#include <ATen/ATen.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "common/cpu_isa.h"
#include "common/ffn_rows.h"
#include "common/quantized_ffn_checks.h"
#include "common/simd_float.h"
#include "common/token_groups.h"

// GCC 12's masked-load intrinsics start from _mm512_undefined_*, which -Wall reports as uninitialised use.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define FLASHLLM_QAVX2 __attribute__((target("avx2,fma,f16c")))
#define FLASHLLM_QAVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))
#define FLASHLLM_QVNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

namespace flashllm {
namespace {

inline uint16_t half_bits_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return bits;
}

inline float half_at(const uint8_t* p) {
  return static_cast<float>(c10::Half(half_bits_at(p), c10::Half::from_bits()));
}

// The same with F16C (one instruction; c10's conversion is a dozen): for the vector paths.
__attribute__((target("f16c"))) inline float half_at_f16c(const uint8_t* p) {
  return _cvtsh_ss(half_bits_at(p));
}

inline int64_t codes_offset(int format) {
  return format == kQ4_1 ? 4 : 2;  // the codes follow d (and Q4_1's m)
}

// Tokens quantized per block: codes [nt][n_blocks * 32] (zeros past d), scale [nt][n_blocks] and scaled sums
// s * sum(codes) [nt][n_blocks]; and for the VNNI path, per pair of blocks p (2p, 2p + 1) and token, 16 int32 lanes of
// 4 codes each in the order the pair's weight codes come in (pair_order), with per lane: the codes (64 bytes), the
// offset correction -offset * (the lane's code sum) that vpdpbusd starts from, the block's scale s, and s times the
// lane's code sum (Q4_1's m term).
struct QuantizedX {
  std::vector<int8_t> codes;
  std::vector<float> scale, scaled_sum;
  int64_t n_blocks, n_pairs;
  std::vector<int8_t> pair_codes;    // [nt][n_pairs * 64]
  std::vector<int32_t> pair_offset;  // [nt][n_pairs * 16]
  std::vector<float> pair_scale;     // [nt][n_pairs * 16]
  std::vector<float> pair_sum;       // [nt][n_pairs * 16]
};

// Where code j (0..63) of a pair's vpdpbusd operand comes from, as (block 0 or 1, column in the block): a 4-bit pair
// decodes as [low nibbles of block 0 | of block 1 | high nibbles of block 0 | of block 1] (weights 0-15 of each block,
// then 16-31), a Q8_0 pair as [block 0 | block 1].
inline std::pair<int, int> pair_order(int format, int j) {
  if (format == kQ8_0) return {j / 32, j % 32};
  return {(j / 16) % 2, (j / 32) * 16 + j % 16};
}

// The unsigned codes' offset per format: Q4_0's nibbles n stand for n - 8, Q8_0's q + 128 (VNNI) for q.
inline int32_t vnni_offset(int format) {
  return format == kQ4_0 ? 8 : format == kQ8_0 ? 128 : 0;
}

// Q8_0's rule with a float32 scale: s = max |x| / 127, code = roundf(x * (1 / s)), as quantize_x_blocks.
QuantizedX quantize_x(const float* x, int nt, int64_t d, int64_t n_blocks, int in_format) {
  const int64_t n_pairs = n_blocks / 2;
  QuantizedX q{std::vector<int8_t>(nt * n_blocks * kBlock, 0),
               std::vector<float>(nt * n_blocks),
               std::vector<float>(nt * n_blocks),
               n_blocks,
               n_pairs,
               std::vector<int8_t>(nt * n_pairs * 64),
               std::vector<int32_t>(nt * n_pairs * 16),
               std::vector<float>(nt * n_pairs * 16),
               std::vector<float>(nt * n_pairs * 16)};
  for (int t = 0; t < nt; ++t)
    for (int64_t b = 0; b < n_blocks; ++b) {
      const float* xb = x + t * d + b * kBlock;
      const int64_t n = std::min<int64_t>(kBlock, d - b * kBlock);
      float amax = 0.f;
      for (int64_t j = 0; j < n; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float s = amax / 127.f, inv = s == 0.f ? 0.f : 1.f / s;
      int8_t* codes = q.codes.data() + (t * n_blocks + b) * kBlock;
      int sum = 0;
      for (int64_t j = 0; j < n; ++j) {
        codes[j] = static_cast<int8_t>(std::round(xb[j] * inv));
        sum += codes[j];
      }
      q.scale[t * n_blocks + b] = s;
      q.scaled_sum[t * n_blocks + b] = s * static_cast<float>(sum);
    }
  const int32_t offset = vnni_offset(in_format);
  for (int t = 0; t < nt; ++t)
    for (int64_t p = 0; p < n_pairs; ++p) {
      const int64_t k = t * n_pairs + p;
      for (int lane = 0; lane < 16; ++lane) {
        int32_t sum = 0;
        int block = 0;
        for (int i = 0; i < 4; ++i) {
          const auto [blk, col] = pair_order(in_format, 4 * lane + i);
          const int8_t code = q.codes[((t * n_blocks) + 2 * p + blk) * kBlock + col];
          q.pair_codes[k * 64 + 4 * lane + i] = code;
          sum += code;
          block = blk;
        }
        const float s = q.scale[t * n_blocks + 2 * p + block];
        q.pair_offset[k * 16 + lane] = -offset * sum;
        q.pair_scale[k * 16 + lane] = s;
        q.pair_sum[k * 16 + lane] = s * static_cast<float>(sum);
      }
    }
  return q;
}

// ---------------------------------------------------------------------------------------------- scalar
// A block's weights as exact integers w (Q4_0: n - 8, Q8_0: q, Q4_1: n) and the term c of w = d * w_int + c.
template <int FMT>
inline float block_ints(const uint8_t* blk, int32_t* w) {
  const uint8_t* codes = blk + codes_offset(FMT);
  if constexpr (FMT == kQ8_0) {
    for (int j = 0; j < kBlock; ++j) w[j] = static_cast<int8_t>(codes[j]);
    return 0.f;
  } else {
    for (int j = 0; j < kBlock / 2; ++j) {
      w[j] = codes[j] & 0x0F;
      w[j + kBlock / 2] = codes[j] >> 4;
    }
    if constexpr (FMT == kQ4_0) {
      for (int j = 0; j < kBlock; ++j) w[j] -= 8;
      return 0.f;
    } else {
      return half_at(blk + 2);
    }
  }
}

template <int FMT, int NT>
void dots_scalar(const uint8_t* col, const QuantizedX& x, int t0, float* out) {
  float acc[NT] = {};
  int32_t w[kBlock];
  for (int64_t b = 0; b < x.n_blocks; ++b) {
    const uint8_t* blk = col + b * block_bytes(FMT);
    const float c = block_ints<FMT>(blk, w), d = half_at(blk);
    for (int t = 0; t < NT; ++t) {
      const int64_t k = (t0 + t) * x.n_blocks + b;
      const int8_t* xq = x.codes.data() + k * kBlock;
      int32_t isum = 0;
      for (int j = 0; j < kBlock; ++j) isum += w[j] * xq[j];
      acc[t] += d * x.scale[k] * static_cast<float>(isum) + c * x.scaled_sum[k];
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = acc[t];
}

template <int FMT, int NT>
void axpy_scalar(const uint8_t* row, const float* h, float* acc, int64_t d) {
  int32_t w[kBlock];
  for (int64_t b = 0, c0 = 0; c0 < d; ++b, c0 += kBlock) {
    const uint8_t* blk = row + b * block_bytes(FMT);
    const float c = block_ints<FMT>(blk, w), scale = half_at(blk);
    const int64_t n = std::min<int64_t>(kBlock, d - c0);
    for (int64_t j = 0; j < n; ++j) {
      const float v = scale * static_cast<float>(w[j]) + c;
      for (int t = 0; t < NT; ++t) acc[t * d + c0 + j] += h[t] * v;
    }
  }
}

// ---------------------------------------------------------------------------------------------- AVX2
// A 4-bit block's 16 code bytes as 32 bytes 0..15 in weight order (low nibbles, then high nibbles).
FLASHLLM_QAVX2 inline __m256i nibbles_avx2(const uint8_t* codes) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m128i low = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low), _mm_and_si128(packed, low));
}

template <int FMT, int NT>
FLASHLLM_QAVX2 void dots_avx2(const uint8_t* col, const QuantizedX& x, int t0, float* out) {
  __m256 acc[NT];
  float corr[NT] = {};
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < x.n_blocks; ++b) {
    const uint8_t* blk = col + b * block_bytes(FMT);
    const uint8_t* codes = blk + codes_offset(FMT);
    const float d = half_at_f16c(blk);
    const float c = FMT == kQ4_0 ? -8.f * d : FMT == kQ4_1 ? half_at_f16c(blk + 2) : 0.f;
    __m256i u;  // unsigned codes; Q8_0: |q|
    __m256i q;
    if constexpr (FMT == kQ8_0) {
      q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
      u = _mm256_sign_epi8(q, q);
    } else {
      u = nibbles_avx2(codes);
    }
    for (int t = 0; t < NT; ++t) {
      const int64_t k = (t0 + t) * x.n_blocks + b;
      __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.codes.data() + k * kBlock));
      if constexpr (FMT == kQ8_0) xq = _mm256_sign_epi8(xq, q);
      const __m256i isum = _mm256_madd_epi16(_mm256_maddubs_epi16(u, xq), ones);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * x.scale[k]), acc[t]);
      corr[t] += c * x.scaled_sum[k];
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = simd::hsum_avx2(acc[t]) + corr[t];
}

// Weights [8 * part, 8 * part + 8) of a block as fp32.
template <int FMT>
FLASHLLM_QAVX2 inline __m256 block_part_avx2(const uint8_t* blk, int part, __m256 d, __m256 c) {
  const uint8_t* codes = blk + codes_offset(FMT);
  __m256i w;
  if constexpr (FMT == kQ8_0) {
    w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * part)));
  } else {
    // Weights 0..15 are the low nibbles of bytes 0..15, weights 16..31 the high nibbles.
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * (part & 1)));
    const __m128i nib = part < 2 ? bytes : _mm_srli_epi16(bytes, 4);
    w = _mm256_cvtepu8_epi32(_mm_and_si128(nib, _mm_set1_epi8(0x0F)));
    if constexpr (FMT == kQ4_0) w = _mm256_sub_epi32(w, _mm256_set1_epi32(8));
  }
  const __m256 scaled = _mm256_mul_ps(d, _mm256_cvtepi32_ps(w));
  return FMT == kQ4_1 ? _mm256_add_ps(scaled, c) : scaled;
}

template <int FMT, int NT>
FLASHLLM_QAVX2 void axpy_avx2(const uint8_t* row, const float* h, float* acc, int64_t d) {
  __m256 hv[NT];
  for (int t = 0; t < NT; ++t) hv[t] = _mm256_set1_ps(h[t]);
  const int64_t whole = d / kBlock;
  for (int64_t b = 0; b < whole; ++b) {
    const uint8_t* blk = row + b * block_bytes(FMT);
    const __m256 scale = _mm256_set1_ps(half_at_f16c(blk));
    const __m256 c = _mm256_set1_ps(FMT == kQ4_1 ? half_at_f16c(blk + 2) : 0.f);
    for (int part = 0; part < 4; ++part) {
      const __m256 w = block_part_avx2<FMT>(blk, part, scale, c);
      for (int t = 0; t < NT; ++t) {
        float* y = acc + t * d + b * kBlock + 8 * part;
        _mm256_storeu_ps(y, _mm256_fmadd_ps(hv[t], w, _mm256_loadu_ps(y)));
      }
    }
  }
  if (whole * kBlock < d) {  // the last, partial block
    int32_t w[kBlock];
    const uint8_t* blk = row + whole * block_bytes(FMT);
    const float c = block_ints<FMT>(blk, w), scale = half_at(blk);
    for (int64_t c0 = whole * kBlock, j = 0; c0 + j < d; ++j) {
      const float v = scale * static_cast<float>(w[j]) + c;
      for (int t = 0; t < NT; ++t) acc[t * d + c0 + j] += h[t] * v;
    }
  }
}

// ---------------------------------------------------------------------------------------------- AVX-512
// A block's 32 codes as unsigned bytes for vpdpbusd, in natural order (Q8_0: q + 128).
template <int FMT>
FLASHLLM_QVNNI inline __m256i unsigned_codes_vnni(const uint8_t* blk) {
  const uint8_t* codes = blk + codes_offset(FMT);
  if constexpr (FMT == kQ8_0)
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)), _mm256_set1_epi8(-128));
  else
    return nibbles_avx2(codes);
}

// A pair of blocks' 64 codes as unsigned bytes in pair_order.
template <int FMT>
FLASHLLM_QVNNI inline __m512i pair_codes_vnni(const uint8_t* blk, int64_t block_bytes_) {
  const uint8_t* codes = blk + codes_offset(FMT);
  if constexpr (FMT == kQ8_0) {
    const __m512i both = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + block_bytes_)), 1);
    return _mm512_xor_si512(both, _mm512_set1_epi8(-128));
  } else {
    const __m256i packed = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + block_bytes_)), 1);
    const __m256i low = _mm256_set1_epi8(0x0F);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(packed, low)),
                              _mm256_and_si256(_mm256_srli_epi16(packed, 4), low), 1);
  }
}

// The float16 values at a and b (a pair's two scales, or mins) spread over the lanes of their blocks (pair_order).
template <int FMT>
FLASHLLM_QVNNI inline __m512 pair_lanes_vnni(const uint8_t* a, const uint8_t* b) {
  const __m128 two = _mm_cvtph_ps(_mm_insert_epi16(_mm_cvtsi32_si128(half_bits_at(a)), half_bits_at(b), 1));
  const __m512i index = FMT == kQ8_0 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)
                                     : _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
  return _mm512_permutexvar_ps(index, _mm512_castps128_ps512(two));
}

// Two blocks per step: one 512-bit vpdpbusd, started from the token's offset correction, then one FMA by the
// blocks' d times the token's per-lane scales (and, Q4_1, one FMA of the mins by s times the lane sums). An odd last
// block is summed alone from the natural-order codes.
template <int FMT, int NT>
FLASHLLM_QVNNI void dots_vnni(const uint8_t* col, const QuantizedX& x, int t0, float* out) {
  constexpr int64_t kBytes = FMT == kQ8_0 ? 34 : FMT == kQ4_0 ? 18 : 20;
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  const int64_t np = x.n_pairs;
  for (int64_t p = 0; p < np; ++p) {
    const uint8_t* blk = col + 2 * p * kBytes;
    const __m512i u = pair_codes_vnni<FMT>(blk, kBytes);
    const __m512 dv = pair_lanes_vnni<FMT>(blk, blk + kBytes);
    __m512 mv;
    if constexpr (FMT == kQ4_1) mv = pair_lanes_vnni<FMT>(blk + 2, blk + kBytes + 2);
    for (int t = 0; t < NT; ++t) {
      const int64_t k = (t0 + t) * np + p;
      const __m512i isum = _mm512_dpbusd_epi32(_mm512_loadu_si512(x.pair_offset.data() + k * 16), u,
                                               _mm512_loadu_si512(x.pair_codes.data() + k * 64));
      const __m512 scale = _mm512_mul_ps(dv, _mm512_loadu_ps(x.pair_scale.data() + k * 16));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[t]);
      if constexpr (FMT == kQ4_1) acc[t] = _mm512_fmadd_ps(mv, _mm512_loadu_ps(x.pair_sum.data() + k * 16), acc[t]);
    }
  }
  float tail[NT] = {};
  if (x.n_blocks % 2) {
    const int64_t b = x.n_blocks - 1;
    const uint8_t* blk = col + b * kBytes;
    const __m256i u = unsigned_codes_vnni<FMT>(blk);
    const float d = half_at_f16c(blk);
    const float c = FMT == kQ4_0 ? -8.f * d : FMT == kQ4_1 ? half_at_f16c(blk + 2) : -128.f * d;
    for (int t = 0; t < NT; ++t) {
      const int64_t k = (t0 + t) * x.n_blocks + b;
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.codes.data() + k * kBlock));
      const __m256i isum = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, xq);
      tail[t] = d * x.scale[k] * simd::hsum_avx2(_mm256_cvtepi32_ps(isum)) + c * x.scaled_sum[k];
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = _mm512_reduce_add_ps(acc[t]) + tail[t];
}

// Weights [16 * half, 16 * half + 16) of a block as fp32.
template <int FMT>
FLASHLLM_QAVX512 inline __m512 block_half_avx512(const uint8_t* blk, int half, __m512 d, __m512 c) {
  const uint8_t* codes = blk + codes_offset(FMT);
  __m512i w;
  if constexpr (FMT == kQ8_0) {
    w = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * half)));
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i nib = half == 0 ? bytes : _mm_srli_epi16(bytes, 4);
    w = _mm512_cvtepu8_epi32(_mm_and_si128(nib, _mm_set1_epi8(0x0F)));
    if constexpr (FMT == kQ4_0) w = _mm512_sub_epi32(w, _mm512_set1_epi32(8));
  }
  const __m512 scaled = _mm512_mul_ps(d, _mm512_cvtepi32_ps(w));
  return FMT == kQ4_1 ? _mm512_add_ps(scaled, c) : scaled;
}

template <int FMT, int NT>
FLASHLLM_QAVX512 void axpy_avx512(const uint8_t* row, const float* h, float* acc, int64_t d) {
  __m512 hv[NT];
  for (int t = 0; t < NT; ++t) hv[t] = _mm512_set1_ps(h[t]);
  for (int64_t b = 0, c0 = 0; c0 < d; ++b, c0 += kBlock) {
    const uint8_t* blk = row + b * block_bytes(FMT);
    const __m512 scale = _mm512_set1_ps(half_at_f16c(blk));
    const __m512 c = _mm512_set1_ps(FMT == kQ4_1 ? half_at_f16c(blk + 2) : 0.f);
    for (int half = 0; half < 2; ++half) {
      const int64_t first = c0 + 16 * half;
      if (first >= d) break;
      const __mmask16 m = d - first >= 16 ? static_cast<__mmask16>(0xFFFF) : simd::first_lanes16(d - first);
      const __m512 w = block_half_avx512<FMT>(blk, half, scale, c);
      for (int t = 0; t < NT; ++t) {
        float* y = acc + t * d + first;
        _mm512_mask_storeu_ps(y, m, _mm512_fmadd_ps(hv[t], w, _mm512_maskz_loadu_ps(m, y)));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------- driver
using DotsFn = void (*)(const uint8_t*, const QuantizedX&, int, float*);
using AxpyFn = void (*)(const uint8_t*, const float*, float*, int64_t);

template <int NT>
DotsFn dots_for(int format, CpuIsa isa) {
  auto pick = [&](auto fmt) -> DotsFn {
    constexpr int F = decltype(fmt)::value;
    if (isa >= CpuIsa::kAvx512Vnni) return &dots_vnni<F, NT>;
    if (isa >= CpuIsa::kAvx2) return &dots_avx2<F, NT>;
    return &dots_scalar<F, NT>;
  };
  if (format == kQ8_0) return pick(std::integral_constant<int, kQ8_0>{});
  if (format == kQ4_0) return pick(std::integral_constant<int, kQ4_0>{});
  return pick(std::integral_constant<int, kQ4_1>{});
}

template <int NT>
AxpyFn axpy_for(int format, CpuIsa isa) {
  auto pick = [&](auto fmt) -> AxpyFn {
    constexpr int F = decltype(fmt)::value;
    if (isa >= CpuIsa::kAvx512) return &axpy_avx512<F, NT>;
    if (isa >= CpuIsa::kAvx2) return &axpy_avx2<F, NT>;
    return &axpy_scalar<F, NT>;
  };
  if (format == kQ8_0) return pick(std::integral_constant<int, kQ8_0>{});
  if (format == kQ4_0) return pick(std::integral_constant<int, kQ4_0>{});
  return pick(std::integral_constant<int, kQ4_1>{});
}

// The rows of a quantized bundle matrix for accumulate_ffn_rows (common/ffn_rows.h).
template <int NT>
struct QuantizedRows {
  const uint8_t* matrix;
  const float* bias_rows;  // per row, or null
  const QuantizedX* x;
  int t0;  // the group's first token
  int64_t d;
  QuantizedBundle layout;
  DotsFn dots_fn;
  AxpyFn axpy_fn;

  void prefetch(int64_t r) const { __builtin_prefetch(matrix + r * layout.row_bytes); }
  void dots(int64_t r, int part, float* out) const {
    dots_fn(matrix + r * layout.row_bytes + part * layout.col_bytes, *x, t0, out);
  }
  void axpy(int64_t r, const float* h, float* acc) const {
    axpy_fn(matrix + r * layout.row_bytes + layout.row_bytes - layout.down_bytes, h, acc, d);
  }
  float bias(int64_t r) const { return bias_rows ? bias_rows[r] : 0.f; }
};

at::Tensor quantized_sparse_ffn_cpu(const at::Tensor& x, const at::Tensor& matrix, int64_t num_used,
                                    const std::optional<at::Tensor>& bias, c10::string_view activation, bool glu,
                                    c10::string_view bundle_format, const std::optional<at::Tensor>& index,
                                    double threshold) {
  const QuantizedBundle layout =
      check_quantized_sparse_ffn_args(x, matrix, num_used, bias, glu, std::string(bundle_format), index, threshold);
  const int act = parse_ffn_activation(std::string(activation), "quantized_sparse_ffn");
  std::vector<int64_t> sorted_index;
  int64_t n_rows = num_used;
  if (index.has_value()) {
    const at::Tensor index_c = index->contiguous();
    n_rows = index_c.numel();
    sorted_index = rows_in_address_order("quantized_sparse_ffn", index_c.data_ptr<int64_t>(), n_rows, num_used);
  }
  const int64_t n_tok = x.size(0), d = x.size(1);
  if (n_tok == 0) return at::empty_like(x, at::MemoryFormat::Contiguous);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor bias_f = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const QuantizedX xq = quantize_x(xf.data_ptr<float>(), static_cast<int>(n_tok), d, layout.n_blocks, layout.in_format);
  at::Tensor yf = at::empty({n_tok, d}, xf.options());
  // Waking the thread team costs more than it saves below ~256 KiB of rows.
  const bool parallel = n_rows * layout.row_bytes >= (256 << 10);
  const CpuIsa isa = active_cpu_isa();
  for (int64_t t0 = 0; t0 < n_tok; t0 += kCpuMaxTokens) {
    const int nt = static_cast<int>(std::min<int64_t>(kCpuMaxTokens, n_tok - t0));
    with_tokens(nt, [&](auto nt_c) {
      constexpr int NT = decltype(nt_c)::value;
      const QuantizedRows<NT> rows{matrix.data_ptr<uint8_t>(),
                                   bias.has_value() ? bias_f.data_ptr<float>() : nullptr,
                                   &xq,
                                   static_cast<int>(t0),
                                   d,
                                   layout,
                                   dots_for<NT>(layout.in_format, isa),
                                   axpy_for<NT>(layout.down_format, isa)};
      const int64_t* ids = index.has_value() ? sorted_index.data() : nullptr;
      sum_row_chunks(n_rows, NT * d, parallel, yf.data_ptr<float>() + t0 * d,
                     [&](int64_t begin, int64_t end, float* acc) {
                       accumulate_ffn_rows<NT>(rows, ids, begin, end, act, glu, static_cast<float>(threshold), acc);
                     });
    });
  }
  return yf.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(flashllm, CPU, m) {
  m.impl("quantized_sparse_ffn", &quantized_sparse_ffn_cpu);
}

}  // namespace flashllm
