// Argument checks of flashllm::quant_scores (CPU only: the predictor's low-bit copies live in DRAM);
// flashllm_ext/ops/quant.py makes the same checks for the reference and fake kernels, with the same words.
#pragma once
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>

namespace flashllm {

inline bool is_quant_bits(int64_t bits) {
  return bits >= 1 && bits <= 4;
}

// 15 * 127 * 2^20 < 2^31: a row's sum of code x int8 products fits in int32 (flashllm_ext/ops/quant.py:
// QUANT_MAX_COLUMNS).
constexpr int64_t kQuantMaxColumns = int64_t{1} << 20;
// A scale group is whole 64-code steps of every path, and whole bytes (flashllm_ext/ops/quant.py:
// QUANT_GROUP_MULTIPLE).
constexpr int64_t kQuantGroupMultiple = 64;

// One low-bit matrix: codes uint8 [n, ceil(d * bits / 8)], scale float16 [n] or [n, groups] (one per d / groups
// columns), bias float32 [n] or none.
inline void check_quant_matrix(const char* name, const at::Tensor& codes, const at::Tensor& scale,
                               const std::optional<at::Tensor>& bias, int64_t bits, int64_t d, int64_t n) {
  TORCH_CHECK(is_quant_bits(bits), "quant_scores: ", name, "_bits must be 1, 2, 3 or 4, got ", bits);
  const int64_t width = (d * bits + 7) / 8;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.size(0) == n && codes.size(1) == width,
              "quant_scores: ", name, "_codes must be uint8 of shape [n=", n, ", ceil(d=", d, " * ", bits,
              " / 8)=", width, "], got ", codes.scalar_type(), " of shape ", codes.sizes());
  TORCH_CHECK(scale.scalar_type() == at::kHalf && (scale.dim() == 1 || scale.dim() == 2) && scale.size(0) == n,
              "quant_scores: ", name, "_scale must be float16 of shape [n=", n, "] or [n=", n, ", groups], got ",
              scale.scalar_type(), " of shape ", scale.sizes());
  const int64_t groups = scale.dim() == 2 ? scale.size(1) : 1;
  TORCH_CHECK(scale.dim() == 1 || (groups > 0 && d % groups == 0 && (d / groups) % kQuantGroupMultiple == 0),
              "quant_scores: ", name, "_scale has ", groups, " groups per row: d=", d,
              " must split into groups of a multiple of ", kQuantGroupMultiple, " columns");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == n),
              "quant_scores: ", name, "_bias must be float32 of shape [n=", n, "], got ",
              bias ? bias->scalar_type() : at::kFloat, " of shape ", bias ? bias->sizes() : at::IntArrayRef{});
  for (const at::Tensor* t : {&codes, &scale})
    TORCH_CHECK(t->device().is_cpu(), "quant_scores: ", name, " tensors are on ", t->device(), " but x is on cpu");
  TORCH_CHECK(!bias || bias->device().is_cpu(), "quant_scores: ", name, " tensors are on ", bias->device(),
              " but x is on cpu");
}

inline void check_quant_scores_args(const at::Tensor& x, const at::Tensor& up_codes, const at::Tensor& up_scale,
                                    const std::optional<at::Tensor>& up_bias,
                                    const std::optional<at::Tensor>& gate_codes,
                                    const std::optional<at::Tensor>& gate_scale,
                                    const std::optional<at::Tensor>& gate_bias, int64_t up_bits, int64_t gate_bits,
                                    c10::string_view activation) {
  TORCH_CHECK(activation == "relu" || activation == "silu" || activation == "gelu" || activation == "gelu_tanh",
              "quant_scores: activation must be one of ('relu', 'silu', 'gelu', 'gelu_tanh'), got '", activation, "'");
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2,
              "quant_scores: x must be a 2-D float32/float16/bfloat16 tensor [T, d], got ", x.scalar_type(),
              " of shape ", x.sizes());
  const int64_t d = x.size(1), n = up_scale.dim() == 1 || up_scale.dim() == 2 ? up_scale.size(0) : -1;
  TORCH_CHECK(d <= kQuantMaxColumns, "quant_scores: x has d=", d, " columns, at most ", kQuantMaxColumns,
              " (the integer dot products of the int8-rounded x sum in int32)");
  TORCH_CHECK(n >= 0, "quant_scores: up_scale must be float16 of shape [n] or [n, groups], got shape ",
              up_scale.sizes());
  check_quant_matrix("up", up_codes, up_scale, up_bias, up_bits, d, n);
  TORCH_CHECK(gate_codes.has_value() == gate_scale.has_value(),
              "quant_scores: gate_codes and gate_scale come together (both for a GLU, neither otherwise)");
  TORCH_CHECK(gate_codes.has_value() || !gate_bias.has_value(), "quant_scores: gate_bias needs gate_codes");
  if (gate_codes) check_quant_matrix("gate", *gate_codes, *gate_scale, gate_bias, gate_bits, d, n);
}

}  // namespace flashllm
