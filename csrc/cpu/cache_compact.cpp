// flashllm::cache_compact on the CPU: swap-delete of neuron cache rows (flashllm_ext/flash/cache.py), O(c * row) for c
// deleted rows, in place on preallocated tensors (a decoding step allocates no tensor memory).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/cache_compact_checks.h"
#include "common/compaction.h"

namespace flashllm {
namespace {

int64_t cache_compact_cpu(at::Tensor& matrix, at::Tensor& pointer, const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& slot_of, int64_t num_used, const at::Tensor& rows_in) {
  check_cache_compact_args(matrix, pointer, bias, slot_of, num_used, rows_in);
  const at::Tensor rows_c = rows_in.contiguous();
  const int64_t c = rows_c.numel();
  // Sorted copy of the deleted rows, kept per thread so a decoding loop does not allocate every step.
  thread_local std::vector<int64_t> sorted;
  sorted.assign(rows_c.data_ptr<int64_t>(), rows_c.data_ptr<int64_t>() + c);
  std::sort(sorted.begin(), sorted.end());
  for (int64_t k = 0; k < c; ++k) {
    TORCH_CHECK(sorted[k] >= 0 && sorted[k] < num_used, "cache_compact: rows holds ", sorted[k],
                ", outside [0, num_used=", num_used, ")");
    TORCH_CHECK(k == 0 || sorted[k] != sorted[k - 1], "cache_compact: rows holds a row twice (", sorted[k], ")");
  }
  int64_t* ptr = pointer.data_ptr<int64_t>();
  int64_t* slots = slot_of.has_value() ? slot_of->data_ptr<int64_t>() : nullptr;
  if (slots != nullptr) {
    const int64_t n_slots = slot_of->numel();
    for (int64_t i = 0; i < num_used; ++i)
      TORCH_CHECK(ptr[i] >= 0 && ptr[i] < n_slots, "cache_compact: pointer[:num_used] holds neuron ids outside [0, ",
                  "slot_of.numel()=", n_slots, ")");
    for (int64_t r : sorted) slots[ptr[r]] = -1;
  }
  const int64_t n_new = num_used - c;
  const int64_t holes = lower_bound_i64(sorted.data(), c, n_new);
  auto* base = static_cast<uint8_t*>(matrix.data_ptr());
  const size_t row_bytes = static_cast<size_t>(matrix.size(1)) * matrix.element_size();
  auto* bias_base = bias.has_value() ? static_cast<uint8_t*>(bias->data_ptr()) : nullptr;
  const size_t bias_bytes = bias.has_value() ? bias->element_size() : 0;
  for (int64_t j = n_new; j < num_used; ++j) {
    const int64_t hole = compaction_hole(sorted.data(), c, holes, n_new, j);
    if (hole < 0) continue;
    // Zero-width rows (a host mirror that moves only pointers) have no data pointer: memcpy from null is undefined.
    if (row_bytes != 0) std::memcpy(base + hole * row_bytes, base + j * row_bytes, row_bytes);
    if (bias_base != nullptr) std::memcpy(bias_base + hole * bias_bytes, bias_base + j * bias_bytes, bias_bytes);
    ptr[hole] = ptr[j];
    if (slots != nullptr) slots[ptr[hole]] = hole;
  }
  std::fill(ptr + n_new, ptr + num_used, int64_t(-1));
  return n_new;
}

}  // namespace

TORCH_LIBRARY_IMPL(flashllm, CPU, m) {
  m.impl("cache_compact", &cache_compact_cpu);
}

}  // namespace flashllm
