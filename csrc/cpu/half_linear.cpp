// flashllm::half_linear on the CPU: y = x W^T + b for weights stored in fp16 or bf16 (fp32 too), in fp32 FMA.
//
// Why: a flash-offloaded model keeps its resident weights (attention, LM head) in the store's fp16, and on CPUs
// without FP16 arithmetic PyTorch's fp16 matmul falls behind once tokens share a weight pass (1.5-3.5x slower than
// this kernel at 8-64 tokens; at one token both are at the read bound: bench/bench_half_linear.py). Decoding is a
// matrix-vector product, bound by reading W once: each row is read once per group of up to 8 tokens
// (common/token_groups.h), widened to fp32 in registers and dotted with every token of the group (common/row_dots.h,
// the loop sparse_ffn uses for its columns). Rows are split across OpenMP threads in static chunks (every row costs the
// same); each writes its own outputs. Longer inputs (prompts) take ATen's fp32 GEMM on fp32 copies of row blocks
// (half_linear_gemm).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "common/cpu_isa.h"
#include "common/half_linear_checks.h"
#include "common/row_dots.h"
#include "common/token_groups.h"

namespace flashllm {
namespace {

using namespace row_dots;

template <class T, int NT>
using DotsFn = void (*)(const T*, const float*, int64_t, float*);

template <class T, int NT>
DotsFn<T, NT> dots_for(CpuIsa isa) {
  if (isa >= CpuIsa::kAvx512) return &dots_avx512<T, NT>;
  if (isa == CpuIsa::kAvx2) return &dots_avx2<T, NT>;
  return &dots_scalar<T, NT>;
}

// y [NT, n] (row stride n) = x [NT, d] W^T + b for one token group.
template <class T, int NT>
void linear_group(const T* weight, const T* bias, const float* x, int64_t n, int64_t d, float* y) {
  const DotsFn<T, NT> dots = dots_for<T, NT>(active_cpu_isa());
  // Waking the thread team costs more than it saves below ~256 KiB of weights.
  const bool parallel = n * d * static_cast<int64_t>(sizeof(T)) >= (256 << 10);
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t r = 0; r < n; ++r) {
    float out[NT];
    dots(weight + r * d, x, d, out);
    const float b = bias ? to_float(bias[r]) : 0.f;
    for (int t = 0; t < NT; ++t) y[t * n + r] = out[t] + b;
  }
}

// Past this many tokens (a prompt) the product is compute-bound: blocks of rows widened to fp32 (~1 MiB each, so the
// transient memory stays small) go through ATen's fp32 GEMM, which uses the cores far better than FMA row loops.
constexpr int64_t kGemmTokens = 2 * kCpuMaxTokens;

void half_linear_gemm(const at::Tensor& xf, const at::Tensor& weight, const at::Tensor* bias, at::Tensor& yf) {
  const int64_t n = weight.size(0), d = weight.size(1);
  const int64_t block = std::max<int64_t>(1, (int64_t{1} << 20) / (4 * d));
  for (int64_t r0 = 0; r0 < n; r0 += block) {
    const int64_t rows = std::min(block, n - r0);
    at::Tensor out = yf.narrow(1, r0, rows);
    const at::Tensor w = weight.narrow(0, r0, rows).to(at::kFloat);
    if (bias) {
      at::addmm_out(out, bias->narrow(0, r0, rows).to(at::kFloat), xf, w.t());
    } else {
      at::mm_out(out, xf, w.t());
    }
  }
}

template <class T>
void half_linear_typed(const at::Tensor& xf, const at::Tensor& weight, const at::Tensor* bias, at::Tensor& yf) {
  const int64_t n_tok = xf.size(0), d = xf.size(1), n = weight.size(0);
  if (n_tok > kGemmTokens) return half_linear_gemm(xf, weight, bias, yf);
  const T* w = weight.data_ptr<T>();
  const T* b = bias ? bias->data_ptr<T>() : nullptr;
  for (int64_t t0 = 0; t0 < n_tok; t0 += kCpuMaxTokens) {
    const int nt = static_cast<int>(std::min<int64_t>(kCpuMaxTokens, n_tok - t0));
    const float* x = xf.data_ptr<float>() + t0 * d;
    float* y = yf.data_ptr<float>() + t0 * n;
    with_tokens(nt, [&](auto nt_c) { linear_group<T, decltype(nt_c)::value>(w, b, x, n, d, y); });
  }
}

at::Tensor half_linear_cpu(const at::Tensor& x, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias_in) {
  check_half_linear_args(x, weight_in, bias_in);
  TORCH_CHECK(x.device().is_cpu(), "half_linear: the CPU kernel got tensors on ", x.device());
  const int64_t n_tok = x.size(0), n = weight_in.size(0);
  // T == 0 or d == 0: empty tensors have no data pointer to read; y is then x W^T + b = b per token (or empty).
  if (n_tok == 0 || x.size(1) == 0) {
    at::Tensor y = at::zeros({n_tok, n}, x.options());
    if (bias_in) y.add_(bias_in->to(x.scalar_type()));
    return y;
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous(), weight = weight_in.contiguous();
  const std::optional<at::Tensor> bias = bias_in ? std::optional<at::Tensor>(bias_in->contiguous()) : std::nullopt;
  const at::Tensor* b = bias ? &*bias : nullptr;
  at::Tensor yf = at::empty({n_tok, n}, x.options().dtype(at::kFloat));
  switch (weight.scalar_type()) {
    case at::kFloat:
      half_linear_typed<float>(xf, weight, b, yf);
      break;
    case at::kHalf:
      half_linear_typed<c10::Half>(xf, weight, b, yf);
      break;
    default:
      half_linear_typed<c10::BFloat16>(xf, weight, b, yf);
      break;
  }
  return x.scalar_type() == at::kFloat ? yf : yf.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(flashllm, CPU, m) {
  m.impl("half_linear", &half_linear_cpu);
}

}  // namespace flashllm
