// flashllm::quantized_sparse_ffn on the CPU: sparse_ffn over bundle rows of GGUF blocks (Q8_0, Q4_0, Q4_1:
// common/quantized_ffn_checks.h), never dequantising an input column.
//
// Each token is first quantized per block of 32 columns (int8 codes, a float32 scale s and s * sum(codes): the op's
// contract, flashllm_ext/ops/blocks.py: quantize_x_blocks), so a column's dot product with a token is, per block b,
// an integer sum of its codes times the token's codes:
//   x . w = sum_b  d_b * s_b * isum_b  +  c_b * (s_b * sum(codes_b))
// where isum_b sums the weight codes u as the path holds them and c_b corrects for how: Q4_0's nibbles n (w = d (n -
// 8): c = -8 d), Q4_1's (w = d n + m: c = m), Q8_0's signed codes q (as they are: c = 0; or, VNNI, q + 128 unsigned: c
// = -128 d). The down row is dequantized a block at a time and added into the output as in sparse_ffn. Per ISA
// (common/cpu_isa.h), a block's integer sum for each of up to 8 tokens:
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
#include "common/quantized_dots.h"
#include "common/quantized_ffn_checks.h"
#include "common/simd_float.h"
#include "common/token_groups.h"

namespace flashllm {
namespace {

using namespace quantized_dots;  // QuantizedX, quantize_x, dots_for, the half and block helpers

// ---------------------------------------------------------------------------------------------- scalar
// acc[t * d + c0 + j] += h[t] * w_j for the weights j < min(32, d - c0) of the block at blk (columns c0...).
template <int FMT, int NT>
void axpy_block_scalar(const uint8_t* blk, const float* h, float* acc, int64_t d, int64_t c0) {
  int32_t w[kBlock];
  const float c = block_ints<FMT>(blk, w), scale = half_at(blk);
  const int64_t n = std::min<int64_t>(kBlock, d - c0);
  for (int64_t j = 0; j < n; ++j) {
    const float v = scale * static_cast<float>(w[j]) + c;
    for (int t = 0; t < NT; ++t) acc[t * d + c0 + j] += h[t] * v;
  }
}

template <int FMT, int NT>
void axpy_scalar(const uint8_t* row, const float* h, float* acc, int64_t d) {
  for (int64_t b = 0, c0 = 0; c0 < d; ++b, c0 += kBlock)
    axpy_block_scalar<FMT, NT>(row + b * block_bytes(FMT), h, acc, d, c0);
}

// ---------------------------------------------------------------------------------------------- AVX2
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
  if (whole * kBlock < d)  // the last, partial block
    axpy_block_scalar<FMT, NT>(row + whole * block_bytes(FMT), h, acc, d, whole * kBlock);
}

// ---------------------------------------------------------------------------------------------- AVX-512
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
using AxpyFn = void (*)(const uint8_t*, const float*, float*, int64_t);

template <int NT>
AxpyFn axpy_for(int format, CpuIsa isa) {
  return with_block_format(format, [&](auto fmt) -> AxpyFn {
    constexpr int F = decltype(fmt)::value;
    if (isa >= CpuIsa::kAvx512) return &axpy_avx512<F, NT>;
    if (isa >= CpuIsa::kAvx2) return &axpy_avx2<F, NT>;
    return &axpy_scalar<F, NT>;
  });
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
  const CpuIsa isa = active_cpu_isa();
  const QuantizedX xq = quantize_x(xf.data_ptr<float>(), static_cast<int>(n_tok), d, layout.n_blocks, layout.in_format,
                                   uses_pair_layout(isa));
  at::Tensor yf = at::empty({n_tok, d}, xf.options());
  // Waking the thread team costs more than it saves below ~256 KiB of rows.
  const bool parallel = n_rows * layout.row_bytes >= (256 << 10);
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
