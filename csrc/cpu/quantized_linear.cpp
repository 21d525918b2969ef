// flashllm::quantized_linear on the CPU: y = x W^T + b for weight rows of GGUF blocks (Q8_0, Q4_0, Q4_1), the rows'
// dot products those of quantized_sparse_ffn's input columns (common/quantized_dots.h): x quantized per block of 32
// columns once per call, then per row and group of up to 8 tokens, integer sums per block. Decoding is a
// matrix-vector product bound by reading W once, so each row is read once per token group; rows are split across
// OpenMP threads in static chunks (every row costs the same), each thread writing its own outputs. Longer inputs (a
// prompt) are compute-bound: x as rounded and blocks of rows dequantized to fp32 go through ATen's fp32 GEMM
// (quantized_linear_gemm), the same products summed in another order.
#include <ATen/ATen.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include "common/cpu_isa.h"
#include "common/quantized_dots.h"
#include "common/quantized_linear_checks.h"
#include "common/token_groups.h"

namespace flashllm {
namespace {

using namespace quantized_dots;

// Past this many tokens the row loop's integer sums lose to a GEMM on dequantized rows (as half_linear's prompts).
constexpr int64_t kGemmTokens = 2 * kCpuMaxTokens;

template <int FMT>
void dequantize_row(const uint8_t* row, int64_t d, float* out) {
  int32_t w[kBlock];
  for (int64_t b = 0, c0 = 0; c0 < d; ++b, c0 += kBlock) {
    const uint8_t* blk = row + b * block_bytes(FMT);
    const float c = block_ints<FMT>(blk, w), scale = half_at(blk);
    for (int64_t j = 0; j < std::min<int64_t>(kBlock, d - c0); ++j) out[c0 + j] = scale * static_cast<float>(w[j]) + c;
  }
}

// yf [T, n] = x (as quantize_x rounded it) W^T + b, W dequantized ~1 MiB of rows at a time.
void quantized_linear_gemm(const QuantizedX& xq, int format, const uint8_t* w, int64_t row_bytes, int64_t n, int64_t d,
                           const float* b, at::Tensor& yf) {
  const int64_t n_tok = yf.size(0), nb = xq.n_blocks;
  at::Tensor xr = at::empty({n_tok, d}, yf.options());
  float* x = xr.data_ptr<float>();
  for (int64_t t = 0; t < n_tok; ++t)
    for (int64_t c = 0; c < d; ++c)
      x[t * d + c] = static_cast<float>(xq.codes[t * nb * kBlock + c]) * xq.scale[t * nb + c / kBlock];
  using DequantizeFn = void (*)(const uint8_t*, int64_t, float*);
  const DequantizeFn dequantize =
      with_block_format(format, [](auto fmt) -> DequantizeFn { return &dequantize_row<decltype(fmt)::value>; });
  const int64_t block = std::max<int64_t>(1, (int64_t{1} << 20) / (4 * d));
  at::Tensor wf = at::empty({std::min(block, n), d}, yf.options());
  for (int64_t r0 = 0; r0 < n; r0 += block) {
    const int64_t rows = std::min(block, n - r0);
    at::Tensor wr = wf.narrow(0, 0, rows);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) dequantize(w + (r0 + r) * row_bytes, d, wr.data_ptr<float>() + r * d);
    at::Tensor out = yf.narrow(1, r0, rows);
    at::mm_out(out, xr, wr.t());
    if (b) out.add_(at::from_blob(const_cast<float*>(b) + r0, {rows}, yf.options()));
  }
}

at::Tensor quantized_linear_cpu(const at::Tensor& x, const at::Tensor& weight, c10::string_view weight_format,
                                const std::optional<at::Tensor>& bias) {
  const int format = check_quantized_linear_args(x, weight, std::string(weight_format), bias);
  const int64_t n_tok = x.size(0), d = x.size(1), n = weight.size(0), row_bytes = weight.size(1);
  at::Tensor y = at::empty({n_tok, n}, x.options().dtype(at::kFloat));
  if (n_tok == 0 || n == 0) return y.to(x.scalar_type());
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t n_blocks = (d + kBlock - 1) / kBlock;
  const CpuIsa isa = active_cpu_isa();
  const bool gemm = n_tok > kGemmTokens;  // (the GEMM path reads x as rounded, not the VNNI path's pair layout)
  const QuantizedX xq =
      quantize_x(xf.data_ptr<float>(), static_cast<int>(n_tok), d, n_blocks, format, !gemm && uses_pair_layout(isa));
  const at::Tensor bias_f = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* b = bias ? bias_f.data_ptr<float>() : nullptr;
  const uint8_t* w = weight.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
  // Below ~64 KiB of rows the thread team costs more than it saves. A decoder's layer calls this every ~100 us, so
  // the team is still spinning from the last call: the default model's 207 KiB output projection (q4) is ~10%
  // faster a sweep of its 30 layers on two threads than on one.
  const int threads = n * row_bytes >= (64 << 10) ? omp_get_max_threads() : 1;
  if (gemm) {
    quantized_linear_gemm(xq, format, w, row_bytes, n, d, b, y);
    return y.to(x.scalar_type());
  }
  for (int64_t t0 = 0; t0 < n_tok; t0 += kCpuMaxTokens) {
    const int nt = static_cast<int>(std::min<int64_t>(kCpuMaxTokens, n_tok - t0));
    with_tokens(nt, [&](auto nt_c) {
      constexpr int NT = decltype(nt_c)::value;
      const DotsFn dots = dots_for<NT>(format, isa);
#pragma omp parallel for schedule(static) num_threads(threads)
      for (int64_t r = 0; r < n; ++r) {
        float acc[NT];
        dots(w + r * row_bytes, xq, static_cast<int>(t0), acc);
        for (int t = 0; t < NT; ++t) out[(t0 + t) * n + r] = acc[t] + (b ? b[r] : 0.f);
      }
    });
  }
  return y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(flashllm, CPU, m) {
  m.impl("quantized_linear", &quantized_linear_cpu);
}

}  // namespace flashllm
