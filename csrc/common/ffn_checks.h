// Argument checks of flashllm::sparse_ffn and flashllm::cache_compact shared by every native kernel (CPU, CUDA,
// SIMT test ops); flashllm_ext/_ops.py makes the same checks for the reference kernels, with the same words.
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

inline bool is_ffn_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

// Returns d, the hidden size.
inline int64_t check_sparse_ffn_args(const at::Tensor& x, const at::Tensor& matrix, int64_t num_used,
                                     const std::optional<at::Tensor>& bias, bool glu,
                                     const std::optional<at::Tensor>& index, double threshold) {
  TORCH_CHECK(is_ffn_dtype(x.scalar_type()) && x.dim() == 2,
              "sparse_ffn: x must be a 2-D float32/float16/bfloat16 tensor [T, d], got ", x.scalar_type(),
              " of shape ", x.sizes());
  const int64_t d = x.size(1);
  const int64_t width = (glu ? 3 : 2) * d;
  TORCH_CHECK(matrix.scalar_type() == x.scalar_type() && matrix.dim() == 2 && matrix.size(1) == width,
              "sparse_ffn: matrix must be ", x.scalar_type(), " of shape [capacity, ", width, "] (",
              glu ? 3 : 2, " x d=", d, "), got ", matrix.scalar_type(), " of shape ", matrix.sizes());
  TORCH_CHECK(matrix.stride(1) == 1 && (matrix.size(0) <= 1 || matrix.stride(0) == width),
              "sparse_ffn: matrix must be contiguous");
  TORCH_CHECK(num_used >= 0 && num_used <= matrix.size(0), "sparse_ffn: num_used=", num_used,
              " is outside [0, capacity=", matrix.size(0), "]");
  TORCH_CHECK(std::isfinite(threshold) && threshold >= 0, "sparse_ffn: threshold must be finite and >= 0, got ",
              threshold);
  TORCH_CHECK(matrix.device() == x.device(), "sparse_ffn: matrix is on ", matrix.device(), " but x is on ",
              x.device());
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

inline void check_cache_compact_args(const at::Tensor& matrix, const at::Tensor& pointer,
                                     const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& slot_of,
                                     int64_t num_used, const at::Tensor& rows) {
  TORCH_CHECK(matrix.dim() == 2 && matrix.is_contiguous(), "cache_compact: matrix must be a contiguous 2-D tensor, "
              "got shape ", matrix.sizes());
  const int64_t capacity = matrix.size(0);
  TORCH_CHECK(pointer.scalar_type() == at::kLong && pointer.dim() == 1 && pointer.size(0) == capacity,
              "cache_compact: pointer must be int64 of shape [capacity=", capacity, "], got ", pointer.scalar_type(),
              " of shape ", pointer.sizes());
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == capacity, "cache_compact: bias must be 1-D of shape [capacity=",
                capacity, "], got shape ", bias->sizes());
  if (slot_of.has_value())
    TORCH_CHECK(slot_of->scalar_type() == at::kLong && slot_of->dim() == 1,
                "cache_compact: slot_of must be a 1-D int64 tensor, got ", slot_of->scalar_type(), " of shape ",
                slot_of->sizes());
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "cache_compact: rows must be a 1-D int64 tensor, "
              "got ", rows.scalar_type(), " of shape ", rows.sizes());
  auto same_device = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.device() == matrix.device(), "cache_compact: ", name, " is on ", t.device(), " but matrix is on ",
                matrix.device());
  };
  same_device(pointer, "pointer");
  if (bias.has_value()) same_device(*bias, "bias");
  if (slot_of.has_value()) same_device(*slot_of, "slot_of");
  same_device(rows, "rows");
  TORCH_CHECK(num_used >= 0 && num_used <= capacity, "cache_compact: num_used=", num_used,
              " is outside [0, capacity=", capacity, "]");
  // Contiguity is what lets the kernels move rows and entries with plain pointer arithmetic.
  TORCH_CHECK(pointer.is_contiguous() && (!bias.has_value() || bias->is_contiguous()) &&
                  (!slot_of.has_value() || slot_of->is_contiguous()),
              "cache_compact: pointer, bias and slot_of must be contiguous (they are updated in place)");
}

inline void check_cache_plan_args(const at::Tensor& active, const at::Tensor& last_active, const at::Tensor& slot_of,
                                  const at::Tensor& pointer, int64_t num_used, int64_t window,
                                  const at::Tensor& evict_rows, const at::Tensor& missing) {
  for (const at::Tensor* t : {&active, &last_active, &slot_of, &pointer, &evict_rows, &missing})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->device().is_cpu(),
                "cache_plan: every argument must be a 1-D int64 CPU tensor, got ", t->scalar_type(), " of shape ",
                t->sizes(), " on ", t->device());
  for (const at::Tensor* t : {&last_active, &slot_of, &pointer, &evict_rows, &missing})
    TORCH_CHECK(t->is_contiguous(), "cache_plan: state tensors must be contiguous");
  TORCH_CHECK(last_active.numel() == slot_of.numel(), "cache_plan: last_active and slot_of must both have one entry "
              "per neuron, got ", last_active.numel(), " and ", slot_of.numel());
  const int64_t capacity = pointer.numel();
  TORCH_CHECK(evict_rows.numel() >= capacity && missing.numel() >= capacity,
              "cache_plan: evict_rows and missing need capacity=", capacity, " entries");
  TORCH_CHECK(num_used >= 0 && num_used <= capacity, "cache_plan: num_used=", num_used, " is outside [0, capacity=",
              capacity, "]");
  TORCH_CHECK(window >= 1, "cache_plan: window must be >= 1, got ", window);
}

}  // namespace flashllm
