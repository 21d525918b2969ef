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
enum FfnActivation : int { kActRelu = 0, kActSilu = 1, kActGelu = 2 };

inline int parse_ffn_activation(const std::string& name) {
  if (name == "relu") return kActRelu;
  if (name == "silu") return kActSilu;
  if (name == "gelu") return kActGelu;
  TORCH_CHECK(false, "sparse_ffn: activation must be one of ('relu', 'silu', 'gelu'), got '", name, "'");
}

inline bool is_ffn_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// Returns d, the hidden size.
inline int64_t check_sparse_ffn_args(const at::Tensor& x, const at::Tensor& matrix, int64_t num_used,
                                     const std::optional<at::Tensor>& bias, bool glu,
                                     const std::optional<at::Tensor>& index, double threshold) {
  TORCH_CHECK(is_ffn_dtype(x.scalar_type()) && x.dim() == 2,
              "sparse_ffn: x must be a 2-D float32/float16/bfloat16 tensor [T, d], got ", x.scalar_type(), " of shape ",
              x.sizes());
  const int64_t d = x.size(1);
  const int64_t width = (glu ? 3 : 2) * d;
  TORCH_CHECK(matrix.scalar_type() == x.scalar_type() && matrix.dim() == 2 && matrix.size(1) == width,
              "sparse_ffn: matrix must be ", x.scalar_type(), " of shape [capacity, ", width, "] (", glu ? 3 : 2,
              " x d=", d, "), got ", matrix.scalar_type(), " of shape ", matrix.sizes());
  TORCH_CHECK(matrix.stride(1) == 1 && (matrix.size(0) <= 1 || matrix.stride(0) == width),
              "sparse_ffn: matrix must be contiguous");
  TORCH_CHECK(num_used >= 0 && num_used <= matrix.size(0), "sparse_ffn: num_used=", num_used,
              " is outside [0, capacity=", matrix.size(0), "]");
  TORCH_CHECK(std::isfinite(threshold) && threshold >= 0, "sparse_ffn: threshold must be finite and >= 0, got ",
              threshold);
  TORCH_CHECK(matrix.device() == x.device(), "sparse_ffn: matrix is on ", matrix.device(), " but x is on ", x.device());
  if (bias.has_value()) {
    TORCH_CHECK(bias->device() == x.device(), "sparse_ffn: bias is on ", bias->device(), " but x is on ", x.device());
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->dim() == 1 && bias->size(0) == matrix.size(0),
                "sparse_ffn: bias must be ", x.scalar_type(), " of shape [capacity=", matrix.size(0), "], got ",
                bias->scalar_type(), " of shape ", bias->sizes());
  }
  if (index.has_value()) {
    TORCH_CHECK(index->device() == x.device(), "sparse_ffn: index is on ", index->device(), " but x is on ",
                x.device());
    TORCH_CHECK(index->scalar_type() == at::kLong && index->dim() == 1,
                "sparse_ffn: index must be a 1-D int64 tensor, got ", index->scalar_type(), " of shape ",
                index->sizes());
  }
  return d;
}

}  // namespace flashllm
