// Argument checks of flashllm::cache_compact shared by every native kernel (CPU, CUDA, SIMT test ops);
// flashllm_ext/ops/cache.py makes the same checks for the reference kernel, with the same words.
//
// Metadata only (dtypes, shapes, devices). Row and neuron id ranges are data: the CPU kernel checks them as it
// goes, the GPU-style host code (csrc/common/ffn_host.h) on the device.
#pragma once
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>

namespace flashllm {

inline void check_cache_compact_args(const at::Tensor& matrix, const at::Tensor& pointer,
                                     const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& slot_of,
                                     int64_t num_used, const at::Tensor& rows) {
  TORCH_CHECK(matrix.dim() == 2 && matrix.is_contiguous(),
              "cache_compact: matrix must be a contiguous 2-D tensor, "
              "got shape ",
              matrix.sizes());
  const int64_t capacity = matrix.size(0);
  TORCH_CHECK(pointer.scalar_type() == at::kLong && pointer.dim() == 1 && pointer.size(0) == capacity,
              "cache_compact: pointer must be int64 of shape [capacity=", capacity, "], got ", pointer.scalar_type(),
              " of shape ", pointer.sizes());
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == capacity,
                "cache_compact: bias must be 1-D of shape [capacity=", capacity, "], got shape ", bias->sizes());
  if (slot_of.has_value())
    TORCH_CHECK(slot_of->scalar_type() == at::kLong && slot_of->dim() == 1,
                "cache_compact: slot_of must be a 1-D int64 tensor, got ", slot_of->scalar_type(), " of shape ",
                slot_of->sizes());
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1,
              "cache_compact: rows must be a 1-D int64 tensor, "
              "got ",
              rows.scalar_type(), " of shape ", rows.sizes());
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

}  // namespace flashllm
