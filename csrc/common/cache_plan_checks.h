// Argument checks of flashllm::cache_plan (CPU only: the cache's bookkeeping state is small and host-side);
// flashllm_ext/ops/cache.py makes the same checks for the reference and fake kernels, with the same words.
#pragma once
#include <ATen/ATen.h>
#include <torch/library.h>

namespace flashllm {

inline void check_cache_plan_args(const at::Tensor& active, const at::Tensor& last_active, const at::Tensor& slot_of,
                                  const at::Tensor& pointer, int64_t num_used, int64_t window,
                                  const at::Tensor& evict_rows, const at::Tensor& missing) {
  for (const at::Tensor* t : {&active, &last_active, &slot_of, &pointer, &evict_rows, &missing})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->device().is_cpu(),
                "cache_plan: every argument must be a 1-D int64 CPU tensor, got ", t->scalar_type(), " of shape ",
                t->sizes(), " on ", t->device());
  for (const at::Tensor* t : {&last_active, &slot_of, &pointer, &evict_rows, &missing})
    TORCH_CHECK(t->is_contiguous(), "cache_plan: state tensors must be contiguous");
  TORCH_CHECK(last_active.numel() == slot_of.numel(),
              "cache_plan: last_active and slot_of must both have one entry "
              "per neuron, got ",
              last_active.numel(), " and ", slot_of.numel());
  const int64_t capacity = pointer.numel();
  TORCH_CHECK(evict_rows.numel() >= capacity && missing.numel() >= capacity,
              "cache_plan: evict_rows and missing need capacity=", capacity, " entries");
  TORCH_CHECK(num_used >= 0 && num_used <= capacity, "cache_plan: num_used=", num_used,
              " is outside [0, capacity=", capacity, "]");
  TORCH_CHECK(window >= 1, "cache_plan: window must be >= 1, got ", window);
}

}  // namespace flashllm
