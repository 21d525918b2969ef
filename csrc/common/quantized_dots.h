// The input-column side of the CPU kernels over rows of GGUF blocks (quantized_sparse_ffn's up and gate columns,
// quantized_linear's weight rows): tokens quantized per block of 32 columns (QuantizedX, the ops' contract:
// flashllm_ext/ops/blocks.py quantize_x_blocks) and a row's dot products with up to 8 of them, per ISA:
//   avx512_vnni  two blocks per 512-bit vpdpbusd (x laid out in the order the pair's codes decode in)
//   avx2         vpmaddubsw + vpmaddwd per block (Q8_0: |q| times x with q's sign, so no int16 pair saturates)
//   scalar       integer loop
// A row's dot product with a token is, per block b, d_b * s_b * (integer sum of codes) plus a per-block correction for
// how the codes are held (common/quantized_ffn_checks.h's formats; csrc/cpu/quantized_sparse_ffn.cpp says how).
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/cpu_isa.h"
#include "common/quantized_ffn_checks.h"
#include "common/simd_float.h"

// GCC 12's masked-load intrinsics start from _mm512_undefined_*, which -Wall reports as uninitialised use.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define FLASHLLM_QAVX2 __attribute__((target("avx2,fma,f16c")))
#define FLASHLLM_QAVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))
#define FLASHLLM_QVNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

namespace flashllm::quantized_dots {

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
  std::vector<int32_t> lane_offset;  // AVX2, Q4_0: [nt][n_blocks * 8], -8 * (the lane's 4 codes' sum)
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
// pair_layout: also the VNNI path's per-pair lanes (only that path reads them).
inline QuantizedX quantize_x(const float* x, int nt, int64_t d, int64_t n_blocks, int in_format, bool pair_layout) {
  const int64_t n_pairs = pair_layout ? n_blocks / 2 : 0;
  QuantizedX q{std::vector<int8_t>(nt * n_blocks * kBlock, 0),
               std::vector<float>(nt * n_blocks),
               std::vector<float>(nt * n_blocks),
               n_blocks,
               n_pairs,
               std::vector<int32_t>(),
               std::vector<int8_t>(nt * n_pairs * 64),
               std::vector<int32_t>(nt * n_pairs * 16),
               std::vector<float>(nt * n_pairs * 16),
               std::vector<float>(nt * n_pairs * 16)};
  for (int t = 0; t < nt; ++t)
    for (int64_t b = 0; b < n_blocks; ++b) {
      const float* xb = x + t * d + b * kBlock;
      const int64_t n = std::min<int64_t>(kBlock, d - b * kBlock);
      float amax = 0.f;
      bool finite = true;
      for (int64_t j = 0; j < n; ++j) {
        amax = std::max(amax, std::fabs(xb[j]));
        finite &= std::isfinite(xb[j]);
      }
      // A block holding inf or NaN gets a NaN scale and zero codes: every output it feeds is NaN, as the reference's.
      const float s = finite ? amax / 127.f : NAN, inv = s == 0.f || !finite ? 0.f : 1.f / s;
      int8_t* codes = q.codes.data() + (t * n_blocks + b) * kBlock;
      int sum = 0;
      for (int64_t j = 0; j < n && finite; ++j) {
        codes[j] = static_cast<int8_t>(std::round(xb[j] * inv));
        sum += codes[j];
      }
      q.scale[t * n_blocks + b] = s;
      q.scaled_sum[t * n_blocks + b] = s * static_cast<float>(sum);
    }
  if (!pair_layout && in_format == kQ4_0) {
    q.lane_offset.resize(nt * n_blocks * 8);
    for (int64_t i = 0; i < nt * n_blocks * 8; ++i)
      q.lane_offset[i] = -8 * (q.codes[4 * i] + q.codes[4 * i + 1] + q.codes[4 * i + 2] + q.codes[4 * i + 3]);
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

// ---------------------------------------------------------------------------------------------- AVX2
// A 4-bit block's 16 code bytes as 32 bytes 0..15 in weight order (low nibbles, then high nibbles): the 16 bytes in
// both halves, the upper half shifted right by 4 (a 64-bit shift: the bits it moves across bytes are masked off).
FLASHLLM_QAVX2 inline __m256i nibbles_avx2(const uint8_t* codes) {
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  return _mm256_and_si256(_mm256_srlv_epi64(both, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
}

// One block's integer sums for token k's codes, 8 int32 lanes (4 products each): Q4_0's nibbles n minus 8 (the lanes
// start from -8 times x's lane sums, QuantizedX::lane_offset), Q4_1's n, Q8_0's q (as |q| times x with q's sign).
template <int FMT>
FLASHLLM_QAVX2 inline __m256i block_isum_avx2(__m256i u, __m256i q, const QuantizedX& x, int64_t k) {
  __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.codes.data() + k * kBlock));
  if constexpr (FMT == kQ8_0) xq = _mm256_sign_epi8(xq, q);
  const __m256i isum = _mm256_madd_epi16(_mm256_maddubs_epi16(u, xq), _mm256_set1_epi16(1));
  if constexpr (FMT == kQ4_0)
    return _mm256_add_epi32(isum, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.lane_offset.data() + k * 8)));
  return isum;
}

// Blocks b and b + 1 go to separate accumulators when there are at most two tokens: one chain of FMAs bound a
// decode token to the FMA's latency (1-2 tokens have too few independent chains to hide it).
template <int FMT, int NT>
FLASHLLM_QAVX2 void dots_avx2(const uint8_t* col, const QuantizedX& x, int t0, float* out) {
  constexpr int U = NT <= 2 ? 2 : 1;
  __m256 acc[U][NT];
  float corr[U][NT] = {};  // Q4_1: m * s * sum(codes)
  for (int u = 0; u < U; ++u)
    for (int t = 0; t < NT; ++t) acc[u][t] = _mm256_setzero_ps();
  const int64_t nb = x.n_blocks;
  auto block = [&](int64_t b, int u_) FLASHLLM_QAVX2 {
    const uint8_t* blk = col + b * block_bytes(FMT);
    const uint8_t* codes = blk + codes_offset(FMT);
    const float d = half_at_f16c(blk);
    __m256i u, q = _mm256_setzero_si256();  // unsigned codes; Q8_0: |q| and q
    if constexpr (FMT == kQ8_0) {
      q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
      u = _mm256_sign_epi8(q, q);
    } else {
      u = nibbles_avx2(codes);
    }
    for (int t = 0; t < NT; ++t) {
      const int64_t k = (t0 + t) * nb + b;
      const __m256i isum = block_isum_avx2<FMT>(u, q, x, k);
      acc[u_][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * x.scale[k]), acc[u_][t]);
      if constexpr (FMT == kQ4_1) corr[u_][t] += half_at_f16c(blk + 2) * x.scaled_sum[k];
    }
  };
  int64_t b = 0;
  for (; b + U <= nb; b += U)
    for (int u = 0; u < U; ++u) block(b + u, u);
  for (; b < nb; ++b) block(b, 0);
  for (int t = 0; t < NT; ++t) {
    __m256 sum = acc[0][t];
    float c = corr[0][t];
    for (int u = 1; u < U; ++u) {
      sum = _mm256_add_ps(sum, acc[u][t]);
      c += corr[u][t];
    }
    out[t] = simd::hsum_avx2(sum) + c;
  }
}

// ---------------------------------------------------------------------------------------------- AVX-512 VNNI
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
    const __m512i both =
        _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes))),
                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + block_bytes_)), 1);
    return _mm512_xor_si512(both, _mm512_set1_epi8(-128));
  } else {
    const __m256i packed =
        _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))),
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

// ---------------------------------------------------------------------------------------------- dispatch
// Whether the ISA runs dots_vnni, which reads QuantizedX's pair layout.
inline bool uses_pair_layout(CpuIsa isa) {
  return isa >= CpuIsa::kAvx512Vnni;
}

using DotsFn = void (*)(const uint8_t*, const QuantizedX&, int, float*);

template <int NT>
DotsFn dots_for(int format, CpuIsa isa) {
  return with_block_format(format, [&](auto fmt) -> DotsFn {
    constexpr int F = decltype(fmt)::value;
    if (uses_pair_layout(isa)) return &dots_vnni<F, NT>;
    if (isa >= CpuIsa::kAvx2) return &dots_avx2<F, NT>;
    return &dots_scalar<F, NT>;
  });
}

}  // namespace flashllm::quantized_dots
