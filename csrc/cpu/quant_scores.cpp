// flashllm::quant_scores on the CPU: |act(x . gate + b) * (x . up + b)| (or |act(x . up + b)|) per neuron from
// low-bit codes with a scale per row or per group of columns, never dequantising a row. x is first rounded to int8 per
// token (the op's contract, every path alike: _ops.round_x_int8), so the dot product of a row with a token is an
// integer sum of code x int8 products.
// Paths by runtime ISA (common/cpu_isa.h), fastest first:
// - AVX-512 VNNI: the codes, unsigned, go to vpdpbusd as they are (4 and 2 and 1 bits: shift and mask a 64-byte load
//   into 64 one-byte codes per step; 3 bits: 24 bytes spread by vpshufb and per-word shifts, or with VBMI (the
//   avx512vbmi2 level) by vpermb and vpmultishiftqb into the same byte order); x is laid out per call
//   in the order those steps produce the codes, so nothing is interleaved per row. The centre comes off each int32
//   lane of a group's sums exactly, then one FMA per lane applies the group's scale (add_group). 64 multiply-adds
//   per instruction against the float path's 16. At T = 1, four rows share each load of x (rows_dots_vnni).
// - AVX-512: the codes decoded 16 at a time in registers (shift, mask, convert) and multiplied into x in fp32 FMA.
// - AVX2: 16 codes per step, each in a 16-bit word (vpshufb gives a word the two bytes holding its code; a per-word
//   power-of-two multiply, AVX2 having no per-word shift, moves the code to the word's top and one uniform shift
//   brings it down), multiplied into x as int16 by vpmaddwd: 16 exact integer multiply-adds per step, x in its
//   natural column order. The centre comes off with each group's integer sum of x: sum (q - c) x = sum q x - c sum x.
// - below: a code byte holds 8 / bits codes, so a row's dot product with one token is a sum over its bytes of a
//   per-(byte position, byte value) partial dot product: lookup tables (256 entries per byte position, built once
//   per call from x in ~256 adds each) turn d multiply-adds per row into d * bits / 8 table reads; 3-bit codes
//   straddle bytes and are decoded 8 at a time (3 bytes) in scalar code instead.
// Up to 8 tokens share one pass over the codes, so the codes, the bytes that matter, are read once per 8 tokens.
// A row is a little-endian bit stream of codes; with groups (each a multiple of 64 columns, so whole bytes) every
// path scores each group as it would a row, from the group's first byte and column.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <optional>
#include <utility>
#include <vector>

#include "common/cpu_isa.h"
#include "common/quant_scores_checks.h"
#include "common/simd_float.h"
#include "common/sparse_ffn_checks.h"

// GCC 12's cast and masked-load intrinsics start from _mm512_undefined_*, which -Wall reports as uninitialised use.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace flashllm {
namespace {

constexpr int64_t kMaxTokens = 8;  // tokens per pass over the codes

// table[(j * 256 + byte) * tb + t] = sum over the codes q_k of `byte` of (q_k - center) * x[t][j * per + k] (columns
// past d count as zero: the padding codes of the last byte never contribute).
void build_tables(const float* x, int64_t x_stride, int64_t tb, int64_t d, int64_t bits, float* table) {
  const int64_t per = 8 / bits, levels = int64_t{1} << bits, width = (d * bits + 7) / 8;
  const float center = static_cast<float>(levels - 1) / 2.f;
  // Serial: the tables are ~300 adds per byte position and token, a few percent of the row pass.
  for (int64_t j = 0; j < width; ++j) {
    float* entry = table + j * 256 * tb;
    for (int64_t t = 0; t < tb; ++t) entry[t] = 0.f;
    // Extend the table of the first k codes (size entries) to k + 1 codes: entry[q * size + b] = entry[b] + (q - c) x.
    // q = 0 last, as it overwrites the entries the others read.
    int64_t size = 1;
    for (int64_t k = 0; k < per; ++k, size *= levels) {
      const int64_t col = j * per + k;
      for (int64_t q = levels - 1; q >= 0; --q) {
        for (int64_t b = 0; b < size; ++b) {
          for (int64_t t = 0; t < tb; ++t) {
            const float xv = col < d ? x[t * x_stride + col] : 0.f;
            entry[(q * size + b) * tb + t] = entry[b * tb + t] + (static_cast<float>(q) - center) * xv;
          }
        }
      }
    }
  }
}

// acc[t] = sum over the row's bytes of its table entries. Four partial sums per token break the add chain (T = 1).
template <int TB>
inline void row_dots(const uint8_t* codes, int64_t width, const float* table, float* acc) {
  float part[4][TB] = {};
  int64_t j = 0;
  for (; j + 4 <= width; j += 4)
    for (int u = 0; u < 4; ++u) {
      const float* e = table + ((j + u) * 256 + codes[j + u]) * TB;
      for (int t = 0; t < TB; ++t) part[u][t] += e[t];
    }
  for (; j < width; ++j) {
    const float* e = table + (j * 256 + codes[j]) * TB;
    for (int t = 0; t < TB; ++t) part[0][t] += e[t];
  }
  for (int t = 0; t < TB; ++t) acc[t] = (part[0][t] + part[1][t]) + (part[2][t] + part[3][t]);
}

// 3-bit rows below AVX-512: 8 codes (3 bytes) per step, decoded by shifts; xpad as for row_dots_avx512.
template <int TB>
void row_dots_3bit(const uint8_t* codes, int64_t width, const float* xpad, int64_t dpad, float* acc) {
  float sum[TB] = {};
  for (int64_t off = 0, col = 0; off < width; off += 3, col += 8) {
    uint32_t raw = 0;
    for (int64_t b = 0; b < 3 && off + b < width; ++b) raw |= static_cast<uint32_t>(codes[off + b]) << (8 * b);
    float w[8];
    for (int k = 0; k < 8; ++k) w[k] = static_cast<float>((raw >> (3 * k)) & 7u) - 3.5f;
    for (int t = 0; t < TB; ++t) {
      const float* xt = xpad + t * dpad + col;
      float part = 0.f;
      for (int k = 0; k < 8; ++k) part += w[k] * xt[k];
      sum[t] += part;
    }
  }
  for (int t = 0; t < TB; ++t) acc[t] = sum[t];
}

// AVX-512: 16 codes per step decoded in registers (per-lane shift and mask), centred, and multiplied into TB
// token accumulators; xpad is the rounded x in fp32, [TB][dpad] with dpad a multiple of 16 and zeros past d (so the
// padding codes of the last byte count for nothing). bits * 2 bytes hold 16 codes. 3 and 4 bits: the low 8 lanes
// decode the first 8 codes from the low 32 bits, the high 8 lanes the next 8 from the bits after them (3 bytes or 4
// bytes on).
template <int TB, int BITS>
__attribute__((target("avx512f"))) void row_dots_avx512(const uint8_t* codes, int64_t width, const float* xpad,
                                                        int64_t dpad, float* acc) {
  constexpr bool kHalves = BITS >= 3;  // 16 codes span more than 32 bits
  const __m512i shifts =
      kHalves ? _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7),
                                   _mm512_set1_epi32(BITS))
              : _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                   _mm512_set1_epi32(BITS));
  const __m512i mask = _mm512_set1_epi32((1 << BITS) - 1);
  const __m512 center = _mm512_set1_ps(static_cast<float>((1 << BITS) - 1) / 2.f);
  constexpr int64_t kStep = BITS * 2;  // bytes per 16 codes
  __m512 sum[TB];
  for (int t = 0; t < TB; ++t) sum[t] = _mm512_setzero_ps();
  const auto accumulate = [&](uint64_t raw, int64_t col) __attribute__((target("avx512f"))) {
    const __m512i lanes = kHalves ? _mm512_inserti64x4(_mm512_set1_epi32(static_cast<int>(raw)),
                                                       _mm256_set1_epi32(static_cast<int>(raw >> (8 * BITS))), 1)
                                  : _mm512_set1_epi32(static_cast<int>(raw));
    const __m512 w =
        _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(lanes, shifts), mask)), center);
    for (int t = 0; t < TB; ++t) sum[t] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xpad + t * dpad + col), sum[t]);
  };
  int64_t off = 0, col = 0;
  // One 8-byte load per step while it stays inside the row (accumulate ignores the bytes past kStep): copying
  // kStep < 8 bytes into a wider integer goes through the stack and stalls store forwarding (3 bits: 6 bytes, 4x
  // slower than the 8-byte steps of 4 bits).
  for (; off + 8 <= width; off += kStep, col += 16) {
    uint64_t raw;
    std::memcpy(&raw, codes + off, 8);
    accumulate(raw, col);
  }
  for (; off < width; off += kStep, col += 16) {  // the row's last groups (never read past the row)
    uint64_t raw = 0;
    std::memcpy(&raw, codes + off, std::min<int64_t>(kStep, width - off));
    accumulate(raw, col);
  }
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_reduce_add_ps(sum[t]);
}

// AVX2 (see the file's head): the vpshufb control and per-word multipliers of one step's 16 codes, 2 * BITS bytes
// broadcast to both 128-bit lanes (lane 0 decodes codes 0-7, lane 1 codes 8-15). Code k starts at bit k * BITS:
// its word takes bytes (k * BITS) / 8 and the next (0x80, a zero, past the step's 8 loaded bytes), and the multiply
// by 2^(16 - BITS - s), s = (k * BITS) % 8, leaves the code in the word's top BITS bits.
struct Avx2DecodeTables {
  alignas(32) uint8_t shuffle[32];
  alignas(32) uint16_t multiplier[16];
};
constexpr Avx2DecodeTables make_avx2_decode_tables(int bits) {
  Avx2DecodeTables t{};
  for (int k = 0; k < 16; ++k) {
    const int byte = k * bits / 8, shift = k * bits % 8, at = 2 * k;  // word k % 8 of lane k / 8: bytes 2k, 2k + 1
    t.shuffle[at] = static_cast<uint8_t>(byte);
    t.shuffle[at + 1] = static_cast<uint8_t>(byte + 1 < 8 ? byte + 1 : 0x80);
    t.multiplier[k] = static_cast<uint16_t>(1u << (16 - bits - shift));
  }
  return t;
}
constexpr Avx2DecodeTables kAvx2Decode[5] = {
    {}, make_avx2_decode_tables(1), make_avx2_decode_tables(2), make_avx2_decode_tables(3), make_avx2_decode_tables(4)};

// acc[t] = the scores' dot product of a row with token t: the sum over its groups of the group's scale x (sum_k q_k
// x_k - centre x sum_k x_k) x the token's scale, x the int8 x (x16: widened to int16, [TB][xstride], zeros past d, so
// the padding codes of the row's last byte count for nothing). A group's sum q x stays in its int32 lanes (exact),
// which one FMA per group scales into float lanes, so a row costs one horizontal sum whatever its groups; the
// centre's share (xcentre: centre x sum x x the token's scale, [TB][groups]) comes off once per row. One call per row,
// its groups' steps back to back: an 8-byte load is safe wherever it stays inside the row.
template <int TB, int BITS>
__attribute__((target("avx2,fma"))) void row_scores_avx2(const uint8_t* row, int64_t width, int64_t groups,
                                                         int64_t group_width, const c10::Half* scale,
                                                         const int16_t* x16, int64_t xstride, const float* xcentre,
                                                         const float* x_scale, float* acc) {
  const __m256i shuffle = _mm256_load_si256(reinterpret_cast<const __m256i*>(kAvx2Decode[BITS].shuffle));
  const __m256i multiplier = _mm256_load_si256(reinterpret_cast<const __m256i*>(kAvx2Decode[BITS].multiplier));
  constexpr int64_t kStep = BITS * 2;  // bytes per 16 codes
  __m256 total[TB];
  float centre[TB] = {};
  for (int t = 0; t < TB; ++t) total[t] = _mm256_setzero_ps();
  int64_t col = 0;
  for (int64_t g = 0; g < groups; ++g) {
    __m256i sum[TB];
    for (int t = 0; t < TB; ++t) sum[t] = _mm256_setzero_si256();
    const auto accumulate = [&](uint64_t raw) __attribute__((target("avx2"))) {
      const __m256i words = _mm256_shuffle_epi8(_mm256_set1_epi64x(static_cast<int64_t>(raw)), shuffle);
      const __m256i q = _mm256_srli_epi16(_mm256_mullo_epi16(words, multiplier), 16 - BITS);
      for (int t = 0; t < TB; ++t) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x16 + t * xstride + col));
        sum[t] = _mm256_add_epi32(sum[t], _mm256_madd_epi16(q, x));
      }
    };
    const int64_t end = g * group_width + group_width;
    int64_t off = g * group_width;
    for (; off < end && off + 8 <= width; off += kStep, col += 16) {
      uint64_t raw;
      std::memcpy(&raw, row + off, 8);
      accumulate(raw);
    }
    for (; off < end; off += kStep, col += 16) {  // the row's last steps (never read past the row)
      uint64_t raw = 0;
      std::memcpy(&raw, row + off, std::min<int64_t>(kStep, width - off));
      accumulate(raw);
    }
    const float s = static_cast<float>(scale[g]);
    for (int t = 0; t < TB; ++t) {
      total[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]), _mm256_set1_ps(s * x_scale[t]), total[t]);
      centre[t] += s * xcentre[t * groups + g];
    }
  }
  for (int t = 0; t < TB; ++t) acc[t] = simd::hsum_avx2(total[t]) - centre[t];
}

// x rounded to int8 per token, the op's contract (flashllm_ext.ops.round_x_int8, which the reference uses):
// q = round(x * (127 / max|x|)) (half to even, as torch.round), scale = max|x| / 127, x ~ q * scale.
// A token with a non-finite entry gets q = 0 and scale NaN, so its every score is NaN, as in the reference.
void round_x_int8(const float* x, int64_t d, int8_t* q, float* scale) {
  float peak = 0.f;
  bool finite = true;
  for (int64_t k = 0; k < d; ++k) {
    finite = finite && std::isfinite(x[k]);
    peak = std::max(peak, std::abs(x[k]));
  }
  if (!finite) {
    std::fill(q, q + d, int8_t{0});
    *scale = std::nanf("");
    return;
  }
  const float inv = peak > 0.f ? 127.f / peak : 0.f;
  // Adding and subtracting 1.5 * 2^23 rounds |v| <= 127 to the nearest integer, half to even (the default rounding
  // mode), as nearbyint does, without its library call; the clamp first (the bounds are integers: same result).
  constexpr float kRound = 12582912.f;
  for (int64_t k = 0; k < d; ++k) {
    const float v = std::clamp(x[k] * inv, -127.f, 127.f);
    q[k] = static_cast<int8_t>((v + kRound) - kRound);
  }
  *scale = peak / 127.f;
}

// ---- AVX-512 VNNI. One step reads a chunk of a row's codes: 64 bytes (512 / bits codes) for 1, 2 and 4 bits,
// 24 bytes (64 codes) for 3 bits, and multiplies each 64 codes it yields into 64 bytes of x laid out in that order.
#define FLASHLLM_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

constexpr int64_t vnni_chunk_bytes(int64_t bits) {
  return bits == 3 ? 24 : 64;
}
constexpr int64_t vnni_chunk_cols(int64_t bits) {
  return bits == 3 ? 64 : 512 / bits;
}
int64_t vnni_chunks(int64_t width, int64_t bits) {
  return (width + vnni_chunk_bytes(bits) - 1) / vnni_chunk_bytes(bits);
}

// The int8 x of one token in the order the chunks yield the codes, zeros past d (so the padding codes of a row's
// last byte, and the zeros a masked load reads past the row, count for nothing). 1, 2 and 4 bits: the j-th shift
// of a chunk's 64 bytes holds code j of each byte, so layout byte j * 64 + p is column p * (8 / bits) + j of the
// chunk. 3 bits: each 128-bit lane yields 16 codes with code m in byte 2m and code m + 8 in byte 2m + 1 (decode3).
void lay_out_x_vnni(const int8_t* q, int64_t d, int64_t bits, int64_t chunks, int8_t* out) {
  const int64_t cols = vnni_chunk_cols(bits);
  const auto at = [&](int64_t col) -> int8_t { return col < d ? q[col] : 0; };
  for (int64_t c = 0; c < chunks; ++c, out += cols) {
    const int64_t first = c * cols;
    if (bits == 3) {
      for (int64_t lane = 0; lane < 64; lane += 16) {
        for (int64_t m = 0; m < 8; ++m) {
          out[lane + 2 * m] = at(first + lane + m);
          out[lane + 2 * m + 1] = at(first + lane + m + 8);
        }
      }
    } else {
      const int64_t per = 8 / bits;
      for (int64_t j = 0; j < per; ++j)
        for (int64_t p = 0; p < 64; ++p) out[j * 64 + p] = at(first + p * per + j);
    }
  }
}

// 3 bits: 16 codes (6 bytes) per 128-bit lane. Code m of a lane's 16 starts at bit 3m: byte (3m) / 8, shift (3m) % 8,
// and code m + 8 (3 bytes on) at the same shift. vpshufb puts those two bytes (and the next) into word m twice; a
// right shift by s brings code m to the word's low byte, a left shift by 8 - s brings code m + 8 to its high byte.
struct Decode3Tables {
  alignas(64) uint8_t low[64], high[64];  // vpshufb controls (per lane, relative to the lane's source bytes)
  alignas(64) uint16_t right[32], left[32];
};
constexpr Decode3Tables make_decode3_tables() {
  Decode3Tables t{};
  // After the qword spread (decode3), lane l's 6 source bytes start at byte lane_start[l] of that lane.
  constexpr int lane_start[4] = {0, 6, 4, 2};
  for (int l = 0; l < 4; ++l) {
    for (int m = 0; m < 8; ++m) {
      const int byte = lane_start[l] + 3 * m / 8, shift = 3 * m % 8, at = 16 * l + 2 * m;
      t.low[at] = static_cast<uint8_t>(byte);
      t.low[at + 1] = static_cast<uint8_t>(byte + 1);
      t.high[at] = static_cast<uint8_t>(byte + 3);
      t.high[at + 1] = static_cast<uint8_t>(byte + 4);
      t.right[8 * l + m] = static_cast<uint16_t>(shift);
      t.left[8 * l + m] = static_cast<uint16_t>(8 - shift);
    }
  }
  return t;
}
constexpr Decode3Tables kDecode3 = make_decode3_tables();

// The 64 codes of 24 bytes (raw: those bytes and 8 more, unused). Lane l needs bytes [6l, 6l + 6): qwords {0,1},
// {0,1}, {1,2}, {2,3} put them at 0, 6, 4, 2 within the lane.
FLASHLLM_VNNI inline __m512i decode3(__m256i raw) {
  const __m512i spread =
      _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 1, 2, 2, 3), _mm512_castsi256_si512(raw));
  const __m512i low = _mm512_srlv_epi16(_mm512_shuffle_epi8(spread, _mm512_load_si512(kDecode3.low)),
                                        _mm512_load_si512(kDecode3.right));
  const __m512i high = _mm512_sllv_epi16(_mm512_shuffle_epi8(spread, _mm512_load_si512(kDecode3.high)),
                                         _mm512_load_si512(kDecode3.left));
  // Low bytes from `low`, high bytes from `high` (ternary 0xE4: c ? a : b), then the 3 code bits of each.
  const __m512i words = _mm512_ternarylogic_epi32(low, high, _mm512_set1_epi16(0x00FF), 0xE4);
  return _mm512_and_si512(words, _mm512_set1_epi8(7));
}

// The same 64 codes in the same byte order with VBMI: qword q = 2l + h of the result holds codes a_i = 16l + 4h + i in
// byte 2i and a_i + 8 in byte 2i + 1. Each run of 4 codes (12 bits) lies in 3 source bytes: vpermb puts the first
// run's bytes in the qword's bytes 0-3 and the second's in 4-7, vpmultishiftqb takes the 8 bits at each code's offset
// into its byte, and the mask keeps the code's 3.
#define FLASHLLM_VNNI_VBMI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")))
struct Multishift3Tables {
  alignas(64) uint8_t bytes[64], offsets[64];
};
constexpr Multishift3Tables make_multishift3_tables() {
  Multishift3Tables t{};
  for (int q = 0; q < 8; ++q) {
    const int first = 16 * (q / 2) + 4 * (q % 2);
    for (int run = 0; run < 2; ++run) {
      const int bit = 3 * (first + 8 * run);
      for (int k = 0; k < 4; ++k) t.bytes[8 * q + 4 * run + k] = static_cast<uint8_t>(bit / 8 + k);
      for (int i = 0; i < 4; ++i) t.offsets[8 * q + 2 * i + run] = static_cast<uint8_t>(32 * run + bit % 8 + 3 * i);
    }
  }
  return t;
}
constexpr Multishift3Tables kMultishift3 = make_multishift3_tables();

FLASHLLM_VNNI_VBMI inline __m512i decode3_multishift(__m256i raw) {
  const __m512i bytes = _mm512_permutexvar_epi8(_mm512_load_si512(kMultishift3.bytes), _mm512_castsi256_si512(raw));
  return _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_load_si512(kMultishift3.offsets), bytes),
                          _mm512_set1_epi8(7));
}

// The first min(count, 64) bytes of p, zeros after: never reads past a row (the last row ends the allocation).
FLASHLLM_VNNI inline __m512i load_bytes(const uint8_t* p, int64_t count) {
  return count >= 64 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8((__mmask64{1} << count) - 1, p);
}

// sum[t] += the 64 codes q times token t's 64 bytes of laid-out x (xstride bytes between tokens).
template <int TB>
FLASHLLM_VNNI inline void dot_step(__m512i (&sum)[TB], __m512i q, const int8_t* x, int64_t xstride) {
#pragma GCC unroll 8
  for (int t = 0; t < TB; ++t) sum[t] = _mm512_dpbusd_epi32(sum[t], q, _mm512_loadu_si512(x + t * xstride));
}

// One 64-byte chunk of 1, 2 or 4-bit codes: shift J yields code J of every byte, for x's J-th 64 bytes (xc).
// Even and odd shifts feed two accumulator sets: two vpdpbusd latency chains per token.
template <int TB, int BITS, int... J>
FLASHLLM_VNNI inline void dot_chunk(__m512i raw, const int8_t* xc, int64_t xstride, __m512i (&even)[TB],
                                    __m512i (&odd)[TB], std::integer_sequence<int, J...>) {
  const __m512i mask = _mm512_set1_epi8((1 << BITS) - 1);
  (dot_step<TB>(J % 2 ? odd : even, _mm512_and_si512(_mm512_srli_epi16(raw, J * BITS), mask), xc + J * 64, xstride),
   ...);
}

inline float activate(float v, int act) {
  switch (act) {
    case kActRelu:
      return v < 0.f ? 0.f : v;  // NaN stays NaN, as torch.relu
    case kActSilu:
      return v / (1.f + std::exp(-v));
    case kActGelu:
      return 0.5f * v * (1.f + std::erf(v * 0.70710678118654752f));
    default:
      return 0.5f * v * (1.f + std::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v)));
  }
}

// kVnniVbmi: the VNNI path with 3-bit codes decoded by VBMI's multishift (multishift3), the rest as kVnni.
enum class Path { kTables, kAvx2, kAvx512, kVnni, kVnniVbmi };
inline bool is_vnni(Path path) {
  return path == Path::kVnni || path == Path::kVnniVbmi;
}

struct Matrix {
  const uint8_t* codes;
  const c10::Half* scale;  // [n, groups]
  const float* bias;       // nullptr for none
  int64_t bits, width;
  // A row is `groups` runs of group_width bytes (group_cols codes), each with its own scale; one scale per row is one
  // group of all d columns (group_width = width). Groups are whole bytes (group_cols is a multiple of 64 when
  // groups > 1), so every path scores a group as it scores a row, from the group's first byte and column.
  int64_t groups, group_cols, group_width;
  // This block of tokens' x as the path reads it: byte tables (kTables, 1/2/4 bits) or the VNNI layout (group g at
  // g * group_layout, tokens xl_stride apart) and (2^bits - 1) x the sums of each group's layout per int32 lane
  // ([TB][groups][16]: the centre's share of each lane of row_dots_vnni).
  const float* table;
  int8_t* xl;
  int64_t group_layout, xl_stride;
  int32_t* xlanes;
  float* xcentre;  // kAvx2: centre x each group's sum of the int8 x x the token's scale ([TB][groups])
};

Matrix matrix_of(const at::Tensor& codes, const at::Tensor& scale, const std::optional<at::Tensor>& bias, int64_t bits,
                 int64_t d) {
  const int64_t width = (d * bits + 7) / 8, groups = scale.dim() == 2 ? scale.size(1) : 1;
  return {codes.data_ptr<uint8_t>(),
          scale.data_ptr<c10::Half>(),
          bias ? bias->data_ptr<float>() : nullptr,
          bits,
          width,
          groups,
          d / groups,
          groups == 1 ? width : d / groups * bits / 8,
          nullptr,
          nullptr,
          0,
          0,
          nullptr,
          nullptr};
}

// Per group, the centre comes off lane by lane in int32 (2 sum - xlanes: exact) and the scale is applied by one FMA
// per lane, so a row costs one horizontal sum whatever its groups. row_scores_vnni and rows_dots_vnni both end so,
// with the same float operations on the same int32 lanes: a token's scores do not depend on the tokens beside it.
FLASHLLM_VNNI inline __m512 add_group(__m512 total, __m512i lanes, const int32_t* xlanes, c10::Half scale) {
  const __m512i centred = _mm512_sub_epi32(_mm512_add_epi32(lanes, lanes), _mm512_loadu_si512(xlanes));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), _mm512_set1_ps(0.5f * static_cast<float>(scale)), total);
}

// T = 1: kRowBlock rows at once (rows_dots_vnni). One row alone is one chain of vpdpbusd, each waiting on the last;
// four rows are four chains sharing each load of x.
constexpr int kRowBlock = 4;

// The row loops, once per decode of 3-bit codes (quant_scores_vnni_rows.h says why twice); the VBMI ones run at
// CpuIsa::kAvx512Vbmi2, whose CPUs have VBMI.
namespace shuffle3 {
#define FLASHLLM_VNNI_ROWS FLASHLLM_VNNI
FLASHLLM_VNNI inline __m512i decode3_rows(__m256i raw) {
  return decode3(raw);
}
#include "cpu/quant_scores_vnni_rows.h"
#undef FLASHLLM_VNNI_ROWS
}  // namespace shuffle3
namespace multishift3 {
#define FLASHLLM_VNNI_ROWS FLASHLLM_VNNI_VBMI
FLASHLLM_VNNI_VBMI inline __m512i decode3_rows(__m256i raw) {
  return decode3_multishift(raw);
}
#include "cpu/quant_scores_vnni_rows.h"
#undef FLASHLLM_VNNI_ROWS
}  // namespace multishift3

// out[l] = levels x the sum over the group's `vectors` 64-byte x vectors of their bytes 4l..4l+3: the part of
// levels x sum(x) that each int32 lane of rows_dots_vnni's sums holds.
FLASHLLM_VNNI void lane_sums_vnni(const int8_t* xl, int64_t vectors, int32_t levels, int32_t* out) {
  __m512i sum = _mm512_setzero_si512();
  for (int64_t v = 0; v < vectors; ++v)
    sum = _mm512_dpbusd_epi32(sum, _mm512_set1_epi8(1), _mm512_loadu_si512(xl + v * 64));
  _mm512_storeu_si512(out, _mm512_mullo_epi32(sum, _mm512_set1_epi32(levels)));
}

// The tokens of one block as the float paths need them: xpad is the rounded x in fp32 ([TB][dpad], dpad a multiple
// of 16, zeros past d); scale per token for VNNI and AVX2; the int8 x as int16 (same layout) for AVX2.
struct Block {
  const float* xpad;
  int64_t dpad;
  const float* scale;
  const int16_t* x16;  // kAvx2: the int8 x widened, [TB][dpad]
};

// One pass over the rows for TB tokens. dots() gives sum_k (q_k - centre) * x_k per token (x rounded, in fp32).
template <int TB>
void score_rows(const Matrix& up, const Matrix* gate, const Block& block, Path path, int act, int64_t n, float* out,
                int64_t out_stride) {
  // acc[t] = sum over the row's groups of scale x sum_k (q_k - centre) * x_k (x rounded, in fp32).
  const auto dots = [&](const Matrix& m, int64_t r, float* acc) {
    if (is_vnni(path)) {
      if (m.bits == 4)
        shuffle3::row_scores_vnni<TB, 4>(m, r, block.scale, acc);
      else if (m.bits == 3 && path == Path::kVnniVbmi)
        multishift3::row_scores_vnni<TB, 3>(m, r, block.scale, acc);
      else if (m.bits == 3)
        shuffle3::row_scores_vnni<TB, 3>(m, r, block.scale, acc);
      else if (m.bits == 2)
        shuffle3::row_scores_vnni<TB, 2>(m, r, block.scale, acc);
      else
        shuffle3::row_scores_vnni<TB, 1>(m, r, block.scale, acc);
      return;
    }
    const uint8_t* row = m.codes + r * m.width;
    const c10::Half* scale = m.scale + r * m.groups;
    if (path == Path::kAvx2) {
      const auto scores = m.bits == 4   ? row_scores_avx2<TB, 4>
                          : m.bits == 3 ? row_scores_avx2<TB, 3>
                          : m.bits == 2 ? row_scores_avx2<TB, 2>
                                        : row_scores_avx2<TB, 1>;
      scores(row, m.width, m.groups, m.group_width, scale, block.x16, block.dpad, m.xcentre, block.scale, acc);
      return;
    }
    for (int t = 0; t < TB; ++t) acc[t] = 0.f;
    for (int64_t g = 0; g < m.groups; ++g) {
      const uint8_t* codes = row + g * m.group_width;
      const int64_t w = m.group_width;
      const float* xpad = block.xpad + g * m.group_cols;
      float part[TB];
      if (path == Path::kAvx512) {
        if (m.bits == 4)
          row_dots_avx512<TB, 4>(codes, w, xpad, block.dpad, part);
        else if (m.bits == 3)
          row_dots_avx512<TB, 3>(codes, w, xpad, block.dpad, part);
        else if (m.bits == 2)
          row_dots_avx512<TB, 2>(codes, w, xpad, block.dpad, part);
        else
          row_dots_avx512<TB, 1>(codes, w, xpad, block.dpad, part);
      } else if (m.bits == 3) {
        row_dots_3bit<TB>(codes, w, xpad, block.dpad, part);
      } else {
        row_dots<TB>(codes, w, m.table + g * w * 256 * TB, part);
      }
      const float s = static_cast<float>(scale[g]);
      for (int t = 0; t < TB; ++t) acc[t] += part[t] * s;
    }
  };
  // rows_dots_vnni for whole blocks of rows at T = 1; dots() row by row otherwise.
  const auto block_dots = [&](const Matrix& m, int64_t r0, int64_t rows, float (*acc)[TB]) {
    if constexpr (TB == 1) {
      if (is_vnni(path) && rows == kRowBlock) {
        float four[kRowBlock];
        if (m.bits == 4)
          shuffle3::rows_dots_vnni<4>(m, r0, block.scale[0], four);
        else if (m.bits == 3 && path == Path::kVnniVbmi)
          multishift3::rows_dots_vnni<3>(m, r0, block.scale[0], four);
        else if (m.bits == 3)
          shuffle3::rows_dots_vnni<3>(m, r0, block.scale[0], four);
        else if (m.bits == 2)
          shuffle3::rows_dots_vnni<2>(m, r0, block.scale[0], four);
        else
          shuffle3::rows_dots_vnni<1>(m, r0, block.scale[0], four);
        for (int i = 0; i < kRowBlock; ++i) acc[i][0] = four[i];
        return;
      }
    }
    for (int64_t i = 0; i < rows; ++i) dots(m, r0 + i, acc[i]);
  };
  // Threads past 256K code bytes x tokens: a decode token of the default model's predictor (~0.77M a layer) takes
  // ~0.6x its one-thread time on two threads (a fork/join costs microseconds against ~200 of scoring); smaller
  // predictors stay on one thread.
  const int64_t blocks = (n + kRowBlock - 1) / kRowBlock;
#pragma omp parallel for schedule(static) if (n * (up.width + (gate ? gate->width : 0)) * TB >= (1 << 18))
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t r0 = b * kRowBlock, rows = std::min<int64_t>(kRowBlock, n - r0);
    float u[kRowBlock][TB], g[kRowBlock][TB];
    block_dots(up, r0, rows, u);
    if (gate) block_dots(*gate, r0, rows, g);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t r = r0 + i;
      const float ub = up.bias ? up.bias[r] : 0.f;
      if (gate) {
        const float gb = gate->bias ? gate->bias[r] : 0.f;
        for (int t = 0; t < TB; ++t) out[t * out_stride + r] = std::abs(activate(g[i][t] + gb, act) * (u[i][t] + ub));
      } else {
        for (int t = 0; t < TB; ++t) out[t * out_stride + r] = std::abs(activate(u[i][t] + ub, act));
      }
    }
  }
}

at::Tensor quant_scores_cpu(const at::Tensor& x_in, const at::Tensor& up_codes_in, const at::Tensor& up_scale_in,
                            const std::optional<at::Tensor>& up_bias_in, const std::optional<at::Tensor>& gate_codes_in,
                            const std::optional<at::Tensor>& gate_scale_in,
                            const std::optional<at::Tensor>& gate_bias_in, int64_t up_bits, int64_t gate_bits,
                            c10::string_view activation) {
  check_quant_scores_args(x_in, up_codes_in, up_scale_in, up_bias_in, gate_codes_in, gate_scale_in, gate_bias_in,
                          up_bits, gate_bits, activation);
  const int act = parse_ffn_activation(std::string(activation));
  const at::Tensor x = x_in.to(at::kFloat).contiguous();  // converted to fp32 once
  const int64_t T = x.size(0), d = x.size(1), n = up_scale_in.size(0);
  at::Tensor out = at::empty({T, n}, x.options());
  if (T == 0 || n == 0) return out;
  const auto contiguous = [](const std::optional<at::Tensor>& t) -> std::optional<at::Tensor> {
    return t ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt;
  };
  const at::Tensor up_codes = up_codes_in.contiguous(), up_scale = up_scale_in.contiguous();
  const std::optional<at::Tensor> up_bias = contiguous(up_bias_in), gate_codes = contiguous(gate_codes_in),
                                  gate_scale = contiguous(gate_scale_in), gate_bias = contiguous(gate_bias_in);
  Matrix up = matrix_of(up_codes, up_scale, up_bias, up_bits, d);
  std::optional<Matrix> gate;
  if (gate_codes) gate = matrix_of(*gate_codes, *gate_scale, gate_bias, gate_bits, d);
  const CpuIsa isa = active_cpu_isa();
  const Path path = isa >= CpuIsa::kAvx512Vbmi2  ? Path::kVnniVbmi
                    : isa >= CpuIsa::kAvx512Vnni ? Path::kVnni
                    : isa >= CpuIsa::kAvx512     ? Path::kAvx512
                    : isa >= CpuIsa::kAvx2       ? Path::kAvx2
                                                 : Path::kTables;

  // x rounded to int8 per token, once for all tokens.
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> x_scale;
  xq.resize(T * d);
  x_scale.resize(T);
  const float* xp = x.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) round_x_int8(xp + t * d, d, xq.data() + t * d, &x_scale[t]);

  // Per block of tokens: the VNNI layouts and lane sums, the int8 x widened to int16 and its group sums (AVX2), or
  // the rounded x in fp32, padded (AVX-512, and 3-bit rows below AVX2), and the byte tables (1, 2 and 4 bits below
  // AVX2).
  const bool up_tables = path == Path::kTables && up_bits != 3;
  const bool gate_tables = path == Path::kTables && gate && gate_bits != 3;
  const bool padded = path == Path::kAvx512 || (path == Path::kTables && (!up_tables || (gate && !gate_tables)));
  const int64_t dpad = (d + 15) / 16 * 16;
  thread_local std::vector<float> rounded, tables, xpad;
  thread_local std::vector<int8_t> layouts;
  thread_local std::vector<int32_t> xlanes;
  thread_local std::vector<float> xcentre;
  thread_local std::vector<int16_t> x16;
  if (path == Path::kAvx512 || path == Path::kTables) {
    rounded.resize(T * d);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < d; ++k) rounded[t * d + k] = static_cast<float>(xq[t * d + k]) * x_scale[t];
  }
  const int64_t up_size = up_tables ? up.width * 256 * kMaxTokens : 0;
  const int64_t gate_size = gate_tables ? gate->width * 256 * kMaxTokens : 0;
  tables.resize(up_size + gate_size);
  up.table = tables.data();
  if (gate) gate->table = tables.data() + up_size;
  xpad.assign(padded ? kMaxTokens * dpad : 0, 0.f);
  Matrix* matrices[2] = {&up, gate ? &*gate : nullptr};
  if (path == Path::kAvx2) {
    x16.assign(kMaxTokens * dpad, 0);
    xcentre.resize(kMaxTokens * (up.groups + (gate ? gate->groups : 0)));
    up.xcentre = xcentre.data();
    if (gate) gate->xcentre = xcentre.data() + kMaxTokens * up.groups;
  }
  if (is_vnni(path)) {
    int64_t layout_bytes = 0, lanes = 0;
    for (Matrix* m : matrices) {
      if (!m) continue;
      m->group_layout = vnni_chunks(m->group_width, m->bits) * vnni_chunk_cols(m->bits);
      // One cache line past each token's layout: at d = 4096 a token's layout is 4 KiB, and 8 tokens 4 KiB apart
      // would share L1 sets (8 ways) with the codes streaming through: 2.5x slower at T = 8 (OPT-6.7B shapes).
      m->xl_stride = m->groups * m->group_layout + 64;
      layout_bytes += kMaxTokens * m->xl_stride;
      lanes += kMaxTokens * m->groups * 16;
    }
    layouts.resize(layout_bytes);
    xlanes.resize(lanes);
    int8_t* next_layout = layouts.data();
    int32_t* next_lanes = xlanes.data();
    for (Matrix* m : matrices) {
      if (!m) continue;
      m->xl = next_layout;
      m->xlanes = next_lanes;
      next_layout += kMaxTokens * m->xl_stride;
      next_lanes += kMaxTokens * m->groups * 16;
    }
  }
  float* op = out.data_ptr<float>();
  for (int64_t t0 = 0; t0 < T; t0 += kMaxTokens) {
    const int64_t tb = std::min(kMaxTokens, T - t0);
    for (int64_t t = 0; t < tb; ++t) {
      if (is_vnni(path)) {
        const int8_t* q = xq.data() + (t0 + t) * d;
        for (Matrix* m : matrices) {
          if (!m) continue;
          int8_t* layout = m->xl + t * m->xl_stride;
          for (int64_t g = 0; g < m->groups; ++g) {
            lay_out_x_vnni(q + g * m->group_cols, m->group_cols, m->bits, vnni_chunks(m->group_width, m->bits),
                           layout + g * m->group_layout);
            lane_sums_vnni(layout + g * m->group_layout, m->group_layout / 64, (1 << m->bits) - 1,
                           m->xlanes + (t * m->groups + g) * 16);
          }
        }
      } else if (path == Path::kAvx2) {
        const int8_t* q = xq.data() + (t0 + t) * d;
        std::copy(q, q + d, x16.data() + t * dpad);
        for (Matrix* m : matrices) {
          if (!m) continue;
          for (int64_t g = 0; g < m->groups; ++g) {
            const int8_t* xg = q + g * m->group_cols;
            const int64_t sum = std::accumulate(xg, xg + m->group_cols, int64_t{0});
            m->xcentre[t * m->groups + g] =
                static_cast<float>(((1 << m->bits) - 1) / 2.0 * static_cast<double>(sum) * x_scale[t0 + t]);
          }
        }
      } else if (padded && d > 0) {  // an empty x has no data pointer; memcpy from null is undefined even for 0 bytes
        std::memcpy(xpad.data() + t * dpad, rounded.data() + (t0 + t) * d, d * sizeof(float));
      }
    }
    if (up_tables) build_tables(rounded.data() + t0 * d, d, tb, d, up_bits, tables.data());
    if (gate_tables) build_tables(rounded.data() + t0 * d, d, tb, d, gate_bits, tables.data() + up_size);
    const Matrix* g = gate ? &*gate : nullptr;
    const Block block{xpad.data(), dpad, x_scale.data() + t0, x16.data()};
    float* o = op + t0 * n;
    switch (tb) {
      case 1:
        score_rows<1>(up, g, block, path, act, n, o, n);
        break;
      case 2:
        score_rows<2>(up, g, block, path, act, n, o, n);
        break;
      case 3:
        score_rows<3>(up, g, block, path, act, n, o, n);
        break;
      case 4:
        score_rows<4>(up, g, block, path, act, n, o, n);
        break;
      case 5:
        score_rows<5>(up, g, block, path, act, n, o, n);
        break;
      case 6:
        score_rows<6>(up, g, block, path, act, n, o, n);
        break;
      case 7:
        score_rows<7>(up, g, block, path, act, n, o, n);
        break;
      default:
        score_rows<8>(up, g, block, path, act, n, o, n);
        break;
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(flashllm, CPU, m) {
  m.impl("quant_scores", &quant_scores_cpu);
}

}  // namespace flashllm
