// flashllm::endor_decompress on the CPU.
//
// Each output row is decoded independently (OpenMP over rows): the row's bitmap is popcounted and checked against
// its row offsets first, then its values are expanded into place. Kernels copy bits, so they are templated on the
// element width (1, 2 or 4 bytes), not on the dtype.
//
// Per ISA, one step of a row decode:
//   avx512vbmi2  masked load of popcount(m) elements, vpexpand{b,w,d} by the bitmap word (64/32/16 columns)
//   avx512       16-bit and 8-bit elements are widened to 32 bits, vpexpandd, narrowed back (16 columns)
//   avx2         one bitmap byte (8 columns): a permutation looked up by the byte, then a lane blend
//   scalar       zero the row, then scatter the set bits (count-trailing-zeros loop)
// Masked loads never touch memory past the row's values, so no path reads out of bounds.
#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/cpu_isa.h"
#include "common/endor_checks.h"
#include "common/endor_report.h"
#include "common/endor_rows.h"
#include "common/simd_float.h"
#include "common/word_dispatch.h"

// GCC 12's masked-load intrinsics start from _mm512_undefined_*, which -Wall reports as uninitialised use.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace flashllm {
namespace {

// ---------------------------------------------------------------------------------------------- scalar
template <typename W>
void decode_row_scalar(const W* v, const uint8_t* bm, int64_t n_cols, W* out) {
  std::memset(out, 0, static_cast<size_t>(n_cols) * sizeof(W));
  for_each_set_column(bm, n_cols, [&](int64_t col) { out[col] = *v++; });
}

// ---------------------------------------------------------------------------------------------- AVX2
template <typename W>
__attribute__((target("avx2,popcnt"))) void decode_row_avx2(const W* v, const uint8_t* bm, int64_t n_cols, W* out,
                                                            const W* v_end) {
  const EndorAvx2Tables& t = endor_avx2_tables();
  const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  int64_t c = 0;
  // Each step reads 8 elements; near the end of `values` that could pass the buffer, so the scalar loop finishes.
  for (; c + 8 <= n_cols && v + 8 <= v_end; c += 8) {
    const uint8_t byte = bm[c / 8];
    if constexpr (sizeof(W) == 4) {
      const __m256i vals = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v));
      const __m256i perm = _mm256_load_si256(reinterpret_cast<const __m256i*>(t.perm32[byte].data()));
      const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(byte), lane_bits), lane_bits);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c),
                          _mm256_and_si256(_mm256_permutevar8x32_epi32(vals, perm), set));
    } else if constexpr (sizeof(W) == 2) {
      const __m128i vals = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
      const __m128i shuf = _mm_load_si128(reinterpret_cast<const __m128i*>(t.shuffle16[byte].data()));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c), _mm_shuffle_epi8(vals, shuf));
    } else {
      const __m128i vals = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(v));
      const __m128i shuf = _mm_load_si128(reinterpret_cast<const __m128i*>(t.shuffle8[byte].data()));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + c), _mm_shuffle_epi8(vals, shuf));
    }
    v += __builtin_popcount(byte);
  }
  if (c < n_cols) decode_row_scalar(v, bm + c / 8, n_cols - c, out + c);
}

// ---------------------------------------------------------------------------------------------- AVX-512
inline __mmask16 first_k16(int k) {
  return static_cast<__mmask16>((1u << k) - 1u);
}  // k <= 16

// 16 columns per step; 8- and 16-bit elements go through 32-bit lanes because vpexpand{b,w} needs VBMI2.
template <typename W>
__attribute__((target("avx512f,avx512bw,avx512vl,popcnt"))) inline void expand16_avx512(const W* v, __mmask16 m,
                                                                                        __mmask16 keep, W* out) {
  const __mmask16 first = first_k16(__builtin_popcount(m));
  // Expands merge into a fresh zero (simd::fresh_zero_si512: zero-masking chains them on AMD Zen 4).
  const __m512i zero = simd::fresh_zero_si512();
  if constexpr (sizeof(W) == 4) {
    _mm512_mask_storeu_epi32(out, keep, _mm512_mask_expand_epi32(zero, m, _mm512_maskz_loadu_epi32(first, v)));
  } else if constexpr (sizeof(W) == 2) {
    const __m512i x = _mm512_mask_expand_epi32(zero, m, _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(first, v)));
    _mm256_mask_storeu_epi16(out, keep, _mm512_cvtepi32_epi16(x));
  } else {
    const __m512i x = _mm512_mask_expand_epi32(zero, m, _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(first, v)));
    _mm_mask_storeu_epi8(out, keep, _mm512_cvtepi32_epi8(x));
  }
}

template <typename W>
__attribute__((target("avx512f,avx512bw,avx512vl,popcnt"))) void decode_row_avx512(const W* v, const uint8_t* bm,
                                                                                   int64_t n_cols, W* out) {
  int64_t c = 0;
  for (; c + 16 <= n_cols; c += 16) {
    const __mmask16 m = load_word<uint16_t>(bm + c / 8);
    expand16_avx512(v, m, static_cast<__mmask16>(0xFFFF), out + c);
    v += __builtin_popcount(m);
  }
  if (c < n_cols) {
    const int64_t left = n_cols - c;
    expand16_avx512(v, static_cast<__mmask16>(load_mask_bytes(bm + c / 8, (left + 7) / 8)),
                    first_k16(static_cast<int>(left)), out + c);
  }
}

// One full 512-bit register per step: 16, 32 or 64 columns of 4-, 2- or 1-byte elements.
template <typename W>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,popcnt"))) inline __m512i expand_vbmi2(const W* v,
                                                                                                    uint64_t m) {
  const int count = __builtin_popcountll(m);
  const uint64_t first = count == 64 ? ~0ull : (1ull << count) - 1;
  const __m512i zero = simd::fresh_zero_si512();  // zero-masked expands chain on AMD Zen 4 (simd::fresh_zero_ps)
  if constexpr (sizeof(W) == 4) {
    return _mm512_mask_expand_epi32(zero, static_cast<__mmask16>(m),
                                    _mm512_maskz_loadu_epi32(static_cast<__mmask16>(first), v));
  } else if constexpr (sizeof(W) == 2) {
    return _mm512_mask_expand_epi16(zero, static_cast<__mmask32>(m),
                                    _mm512_maskz_loadu_epi16(static_cast<__mmask32>(first), v));
  } else {
    return _mm512_mask_expand_epi8(zero, m, _mm512_maskz_loadu_epi8(first, v));
  }
}

template <typename W>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,popcnt"))) void decode_row_avx512_vbmi2(const W* v,
                                                                                                     const uint8_t* bm,
                                                                                                     int64_t n_cols,
                                                                                                     W* out) {
  constexpr int64_t kStep = 64 / sizeof(W);
  using Word = std::conditional_t<kStep == 64, uint64_t, std::conditional_t<kStep == 32, uint32_t, uint16_t>>;
  int64_t c = 0;
  for (; c + kStep <= n_cols; c += kStep) {  // plain stores: masked ones are slow on some cores (AMD Zen 4)
    const uint64_t m = load_word<Word>(bm + c / 8);
    _mm512_storeu_si512(out + c, expand_vbmi2(v, m));
    v += __builtin_popcountll(m);
  }
  if (c < n_cols) {
    const int64_t left = n_cols - c;
    const __m512i x = expand_vbmi2(v, load_mask_bytes(bm + c / 8, (left + 7) / 8));
    const uint64_t keep = (1ull << left) - 1;
    if constexpr (sizeof(W) == 4) {
      _mm512_mask_storeu_epi32(out + c, static_cast<__mmask16>(keep), x);
    } else if constexpr (sizeof(W) == 2) {
      _mm512_mask_storeu_epi16(out + c, static_cast<__mmask32>(keep), x);
    } else {
      _mm512_mask_storeu_epi8(out + c, keep, x);
    }
  }
}

// ---------------------------------------------------------------------------------------------- driver
// Decodes every output row; returns the lowest refused output row and why, packed as in EndorReport::bad_row
// (row << kEndorCodeBits | EndorRowCode), or kEndorNoError. The caller words the error (common/endor_report.h).
template <typename W>
unsigned long long decompress(const W* values, int64_t nnz, const uint8_t* bitmap, const int64_t* offsets,
                              int64_t n_rows, int64_t n_cols, const int64_t* rows, int64_t n_out, W* out) {
  const CpuIsa isa = active_cpu_isa();
  const int64_t n_bytes = (n_cols + 7) / 8;
  LowestBadRow bad_row;
  // Rows are independent; a small dynamic chunk balances rows of uneven density across threads. Below ~256 KiB of
  // output, waking the thread team costs more than it saves.
  const bool parallel = n_out * n_cols * static_cast<int64_t>(sizeof(W)) >= (256 << 10);
#pragma omp parallel for schedule(dynamic, 16) if (parallel)
  for (int64_t i = 0; i < n_out; ++i) {
    const int64_t r = rows ? rows[i] : i;
    if (rows && i + 1 < n_out) {  // gathered rows are scattered in memory: start fetching the next one now
      const int64_t next = rows[i + 1];
      if (next >= 0 && next < n_rows) {
        __builtin_prefetch(bitmap + next * n_bytes);
        __builtin_prefetch(values + offsets[next]);
      }
    }
    int64_t start = 0;
    const int code = endor_row_code(bitmap, offsets, r, n_rows, n_cols, nnz, &start);
    if (code != kEndorRowOk) {
      bad_row.note(i, code);
      continue;
    }
    const W* v = values + start;
    const uint8_t* bm = bitmap + r * n_bytes;
    W* dst = out + i * n_cols;
    switch (isa) {
      case CpuIsa::kAvx512Bf16:
      case CpuIsa::kAvx512Vbmi2:
        decode_row_avx512_vbmi2(v, bm, n_cols, dst);
        break;
      case CpuIsa::kAvx512Vnni:
      case CpuIsa::kAvx512:
        decode_row_avx512(v, bm, n_cols, dst);
        break;
      case CpuIsa::kAvx2:
        decode_row_avx2(v, bm, n_cols, dst, values + nnz);
        break;
      default:
        decode_row_scalar(v, bm, n_cols, dst);
    }
  }
  return bad_row.packed();
}

void endor_decompress_out_cpu(const at::Tensor& values_in, const at::Tensor& bitmap_in,
                              const at::Tensor& row_offsets_in, int64_t n_cols,
                              const std::optional<at::Tensor>& rows_in, at::Tensor out) {
  check_endor_args(values_in, bitmap_in, row_offsets_in, n_cols, rows_in, &out);
  const at::Tensor values = values_in.contiguous(), bitmap = bitmap_in.contiguous();
  const at::Tensor offsets = row_offsets_in.contiguous();
  const std::optional<at::Tensor> rows = rows_in ? std::optional<at::Tensor>(rows_in->contiguous()) : std::nullopt;
  const int64_t n_rows = bitmap.size(0), nnz = values.numel();
  const int64_t* off = offsets.data_ptr<int64_t>();
  check_endor_offset_ends("endor_decompress", off[0], off[n_rows], nnz);
  const int64_t* row_ids = rows ? rows->data_ptr<int64_t>() : nullptr;
  const int64_t n_out = out.size(0);
  const uint8_t* bm = bitmap.data_ptr<uint8_t>();
  const unsigned long long bad_row = dispatch_word(values.element_size(), [&](auto word) {
    using W = decltype(word);
    return decompress(static_cast<const W*>(values.data_ptr()), nnz, bm, off, n_rows, n_cols, row_ids, n_out,
                      static_cast<W*>(out.data_ptr()));
  });
  throw_if_endor_bad_row("endor_decompress", bad_row, values, bitmap, offsets, n_cols, rows);
}

}  // namespace

TORCH_LIBRARY_IMPL(flashllm, CPU, m) {
  m.impl("endor_decompress", &endor_decompress_allocating<&endor_decompress_out_cpu>);
  m.impl("endor_decompress.out", &endor_decompress_out_cpu);
}

}  // namespace flashllm
