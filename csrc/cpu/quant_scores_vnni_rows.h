// quant_scores' AVX-512 VNNI row loops, included twice by quant_scores.cpp: once compiled for AVX-512 VNNI with the
// shuffle decode of 3-bit codes, once for VNNI + VBMI with the multishift decode (same codes in the same byte order,
// so the same x layout; measured 1.2-1.3x faster on 3-bit rows on Zen 4). Two compilations rather than one with
// VBMI enabled: with VBMI allowed, the compiler may turn the shuffle decode's constant permutations into VBMI
// instructions, and a CPU with VNNI but no VBMI (Cascade Lake) would fault. The includer defines FLASHLLM_VNNI_ROWS
// (the functions' target attribute) and decode3_rows (64 codes from 24 bytes), and wraps the include in a namespace.
// No include guard, on purpose.

// The 64 codes of the 24-byte chunk of 3-bit codes at `off`; reads 32 bytes, the last 8 only while inside the row.
FLASHLLM_VNNI_ROWS inline __m512i chunk3(const uint8_t* codes, int64_t off, int64_t width) {
  return decode3_rows(off + 32 <= width ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + off))
                                        : _mm256_maskz_loadu_epi8((__mmask32{1} << (width - off)) - 1, codes + off));
}

template <int TB>
FLASHLLM_VNNI_ROWS inline void dot_chunk3(const uint8_t* codes, int64_t off, int64_t width, const int8_t* xc,
                                          int64_t xstride, __m512i (&sum)[TB]) {
  dot_step<TB>(sum, chunk3(codes, off, width), xc, xstride);
}

// lanes[t] = the sum over a row's (or group's) codes q_k of q_k * xq[t][k], spread over 16 int32 lanes as vpdpbusd
// leaves it (exact: |lane| <= 15 * 127 * d < 2^31 for the d <= 2^20 the checks allow); xl: the tokens' laid-out x,
// xstride bytes apart.
template <int TB, int BITS>
FLASHLLM_VNNI_ROWS void row_dots_vnni(const uint8_t* codes, int64_t width, const int8_t* xl, int64_t xstride,
                                      __m512i (&lanes)[TB]) {
  // Every loop over t fully unrolled, so the accumulators stay in registers (a rolled loop keeps the arrays in
  // memory and stores every vpdpbusd result).
  __m512i even[TB], odd[TB];
#pragma GCC unroll 8
  for (int t = 0; t < TB; ++t) even[t] = odd[t] = _mm512_setzero_si512();
  const int64_t chunks = vnni_chunks(width, BITS);
  if constexpr (BITS == 3) {
    int64_t c = 0;
    for (; c + 2 <= chunks; c += 2) {
      dot_chunk3<TB>(codes, c * 24, width, xl + c * 64, xstride, even);
      dot_chunk3<TB>(codes, c * 24 + 24, width, xl + c * 64 + 64, xstride, odd);
    }
    if (c < chunks) dot_chunk3<TB>(codes, c * 24, width, xl + c * 64, xstride, even);
  } else {
    constexpr int kPer = 8 / BITS;
    for (int64_t c = 0; c < chunks; ++c) {
      dot_chunk<TB, BITS>(load_bytes(codes + c * 64, width - c * 64), xl + c * kPer * 64, xstride, even, odd,
                          std::make_integer_sequence<int, kPer>{});
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < TB; ++t) lanes[t] = _mm512_add_epi32(even[t], odd[t]);
}

// acc[t] = sum over row r's groups of scale x sum_k (q_k - centre) * x_k, for TB tokens.
template <int TB, int BITS>
FLASHLLM_VNNI_ROWS void row_scores_vnni(const Matrix& m, int64_t r, const float* x_scale, float* acc) {
  __m512 total[TB];
#pragma GCC unroll 8
  for (int t = 0; t < TB; ++t) total[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < m.groups; ++g) {
    __m512i lanes[TB];
    row_dots_vnni<TB, BITS>(m.codes + r * m.width + g * m.group_width, m.group_width, m.xl + g * m.group_layout,
                            m.xl_stride, lanes);
#pragma GCC unroll 8
    for (int t = 0; t < TB; ++t)
      total[t] = add_group(total[t], lanes[t], m.xlanes + (t * m.groups + g) * 16, m.scale[r * m.groups + g]);
  }
#pragma GCC unroll 8
  for (int t = 0; t < TB; ++t) acc[t] = _mm512_reduce_add_ps(total[t]) * x_scale[t];
}

// T = 1, kRowBlock rows at once: acc[i] = row_scores_vnni of row r0 + i.
template <int BITS>
FLASHLLM_VNNI_ROWS void rows_dots_vnni(const Matrix& m, int64_t r0, float x_scale, float* acc) {
  __m512 total[kRowBlock];
#pragma GCC unroll 4
  for (int i = 0; i < kRowBlock; ++i) total[i] = _mm512_setzero_ps();
  const int64_t chunks = vnni_chunks(m.group_width, BITS);
  for (int64_t g = 0; g < m.groups; ++g) {
    const int8_t* xl = m.xl + g * m.group_layout;
    const uint8_t* codes = m.codes + r0 * m.width + g * m.group_width;
    __m512i sum[kRowBlock];
#pragma GCC unroll 4
    for (int i = 0; i < kRowBlock; ++i) sum[i] = _mm512_setzero_si512();
    if constexpr (BITS == 3) {
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512i xv = _mm512_loadu_si512(xl + c * 64);
#pragma GCC unroll 4
        for (int i = 0; i < kRowBlock; ++i)
          sum[i] = _mm512_dpbusd_epi32(sum[i], chunk3(codes + i * m.width, c * 24, m.group_width), xv);
      }
    } else {
      constexpr int kPer = 8 / BITS;
      const __m512i mask = _mm512_set1_epi8((1 << BITS) - 1);
      for (int64_t c = 0; c < chunks; ++c) {
        __m512i raw[kRowBlock];
#pragma GCC unroll 4
        for (int i = 0; i < kRowBlock; ++i) raw[i] = load_bytes(codes + i * m.width + c * 64, m.group_width - c * 64);
#pragma GCC unroll 8
        for (int j = 0; j < kPer; ++j) {
          const __m512i xv = _mm512_loadu_si512(xl + (c * kPer + j) * 64);
          const __m128i shift = _mm_cvtsi32_si128(j * BITS);
#pragma GCC unroll 4
          for (int i = 0; i < kRowBlock; ++i)
            sum[i] = _mm512_dpbusd_epi32(sum[i], _mm512_and_si512(_mm512_srl_epi16(raw[i], shift), mask), xv);
        }
      }
    }
    const c10::Half* scale = m.scale + r0 * m.groups + g;
#pragma GCC unroll 4
    for (int i = 0; i < kRowBlock; ++i) total[i] = add_group(total[i], sum[i], m.xlanes + g * 16, scale[i * m.groups]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < kRowBlock; ++i) acc[i] = _mm512_reduce_add_ps(total[i]) * x_scale;
}
