// flashllm::quantized_linear on the CPU: y = x W^T + b for weight rows of GGUF blocks (Q8_0, Q4_0, Q4_1), the rows'
// dot products those of quantized_sparse_ffn's input columns (common/quantized_dots.h): x quantized per block of 32
// columns once per call, then per row and group of up to 8 tokens, integer sums per block. Decoding is a
// matrix-vector product bound by reading W once, so each row is read once per token group; rows are split across
// OpenMP threads in static chunks (every row costs the same), each thread writing its own outputs.
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

at::Tensor quantized_linear_cpu(const at::Tensor& x, const at::Tensor& weight, c10::string_view weight_format,
                                const std::optional<at::Tensor>& bias) {
  const int format = check_quantized_linear_args(x, weight, std::string(weight_format), bias);
  const int64_t n_tok = x.size(0), d = x.size(1), n = weight.size(0), row_bytes = weight.size(1);
  at::Tensor y = at::empty({n_tok, n}, x.options().dtype(at::kFloat));
  if (n_tok == 0 || n == 0) return y.to(x.scalar_type());
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t n_blocks = (d + kBlock - 1) / kBlock;
  const QuantizedX xq = quantize_x(xf.data_ptr<float>(), static_cast<int>(n_tok), d, n_blocks, format);
  const at::Tensor bias_f = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* b = bias ? bias_f.data_ptr<float>() : nullptr;
  const uint8_t* w = weight.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
  const CpuIsa isa = active_cpu_isa();
  // Waking the thread team costs more than it saves below ~256 KiB of rows.
  const int threads = n * row_bytes >= (256 << 10) ? omp_get_max_threads() : 1;
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
