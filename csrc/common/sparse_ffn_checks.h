// Argument checks of flashllm::sparse_ffn shared by every native kernel (CPU, CUDA, SIMT test ops);
// flashllm_ext/ops/ffn.py makes the same checks for the reference kernel, with the same words.
//
// Metadata only (dtypes, shapes, devices). Index ranges are data: the CPU kernels check them as they go, the CUDA
// glue only with kernel checks on (common/kernel_checks.h), the SIMT test ops always (common/ffn_host.h).
#pragma once
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string>

namespace flashllm {

// Activation codes shared with the CUDA and Metal bodies (csrc/cuda/sparse_ffn_kernel.cuh, metal/sparse_ffn_*.metal).
// kActGeluTanh: GELU's tanh approximation (Gemma's gelu_pytorch_tanh), a different function from the erf form.
enum FfnActivation : int { kActRelu = 0, kActSilu = 1, kActGelu = 2, kActGeluTanh = 3 };

inline int parse_ffn_activation(const std::string& name, const char* op = "sparse_ffn") {
  if (name == "relu") return kActRelu;
  if (name == "silu") return kActSilu;
  if (name == "gelu") return kActGelu;
  if (name == "gelu_tanh") return kActGeluTanh;
  TORCH_CHECK(false, op, ": activation must be one of ('relu', 'silu', 'gelu', 'gelu_tanh'), got '", name, "'");
}

inline bool is_ffn_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// x [T, d] of a float dtype; returns d, the hidden size.
inline int64_t check_ffn_x(const char* op, const at::Tensor& x) {
  TORCH_CHECK(is_ffn_dtype(x.scalar_type()) && x.dim() == 2, op,
              ": x must be a 2-D float32/float16/bfloat16 tensor [T, d], got ", x.scalar_type(), " of shape ",
              x.sizes());
  return x.size(1);
}

// Every check but x's and the matrix's dtype and width (the op's own): the matrix is contiguous [capacity, width].
inline void check_ffn_rows_args(const char* op, const at::Tensor& x, const at::Tensor& matrix, int64_t width,
                                int64_t num_used, const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& index, double threshold) {
  TORCH_CHECK(matrix.stride(1) == 1 && (matrix.size(0) <= 1 || matrix.stride(0) == width), op,
              ": matrix must be contiguous");
  TORCH_CHECK(num_used >= 0 && num_used <= matrix.size(0), op, ": num_used=", num_used,
              " is outside [0, capacity=", matrix.size(0), "]");
  TORCH_CHECK(std::isfinite(threshold) && threshold >= 0, op, ": threshold must be finite and >= 0, got ", threshold);
  TORCH_CHECK(matrix.device() == x.device(), op, ": matrix is on ", matrix.device(), " but x is on ", x.device());
  if (bias.has_value()) {
    TORCH_CHECK(bias->device() == x.device(), op, ": bias is on ", bias->device(), " but x is on ", x.device());
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->dim() == 1 && bias->size(0) == matrix.size(0), op,
                ": bias must be ", x.scalar_type(), " of shape [capacity=", matrix.size(0), "], got ",
                bias->scalar_type(), " of shape ", bias->sizes());
  }
  if (index.has_value()) {
    TORCH_CHECK(index->device() == x.device(), op, ": index is on ", index->device(), " but x is on ", x.device());
    TORCH_CHECK(index->scalar_type() == at::kLong && index->dim() == 1, op, ": index must be a 1-D int64 tensor, got ",
                index->scalar_type(), " of shape ", index->sizes());
  }
}

// Returns d, the hidden size.
inline int64_t check_sparse_ffn_args(const at::Tensor& x, const at::Tensor& matrix, int64_t num_used,
                                     const std::optional<at::Tensor>& bias, bool glu,
                                     const std::optional<at::Tensor>& index, double threshold) {
  const int64_t d = check_ffn_x("sparse_ffn", x);
  const int64_t width = (glu ? 3 : 2) * d;
  TORCH_CHECK(matrix.scalar_type() == x.scalar_type() && matrix.dim() == 2 && matrix.size(1) == width,
              "sparse_ffn: matrix must be ", x.scalar_type(), " of shape [capacity, ", width, "] (", glu ? 3 : 2,
              " x d=", d, "), got ", matrix.scalar_type(), " of shape ", matrix.sizes());
  check_ffn_rows_args("sparse_ffn", x, matrix, width, num_used, bias, index, threshold);
  return d;
}

}  // namespace flashllm
