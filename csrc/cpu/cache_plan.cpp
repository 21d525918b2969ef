// flashllm::cache_plan on the CPU: one token's decisions of the neuron cache (flashllm_ext/flash/cache.py): which rows
// leave (window, then least-recently-active when the budget is short) and which neurons must be read. O(k + num_used)
// for k active ids, in place on preallocated tensors (a decoding step allocates no tensor memory).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "common/cache_plan_checks.h"

namespace flashllm {
namespace {

// The counts are returned as SymInt (the schema says SymInt[]) so the fake kernel can return unbacked sizes for them.
std::vector<c10::SymInt> cache_plan_cpu(const at::Tensor& active_in, at::Tensor& last_active, at::Tensor& slot_of,
                                        const at::Tensor& pointer, int64_t num_used, int64_t step, int64_t window,
                                        at::Tensor& evict_rows, at::Tensor& missing) {
  check_cache_plan_args(active_in, last_active, slot_of, pointer, num_used, window, evict_rows, missing);
  const at::Tensor active_c = active_in.contiguous();
  const int64_t k = active_c.numel(), n_neurons = slot_of.numel(), capacity = pointer.numel();
  const int64_t* ids = active_c.data_ptr<int64_t>();
  int64_t* last = last_active.data_ptr<int64_t>();
  int64_t* slots = slot_of.data_ptr<int64_t>();
  const int64_t* ptr = pointer.data_ptr<int64_t>();
  int64_t* evict = evict_rows.data_ptr<int64_t>();
  int64_t* miss = missing.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_used; ++i)
    TORCH_CHECK(ptr[i] >= 0 && ptr[i] < n_neurons && slots[ptr[i]] == i, "cache_plan: pointer[", i, "]=", ptr[i],
                " disagrees with slot_of: the cache state is corrupt");
  // An active neuron's slot decides whether it is read: one outside the used rows would be taken as cached.
  for (int64_t i = 0; i < k; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < n_neurons, "cache_plan: active_ids[", i, "]=", ids[i],
                " is outside [0, n_neurons=", n_neurons, ")");
    const int64_t slot = slots[ids[i]];
    TORCH_CHECK(slot < 0 || (slot < num_used && ptr[slot] == ids[i]), "cache_plan: slot_of[", ids[i], "]=", slot,
                " disagrees with pointer: the cache state is corrupt");
  }
  // Distinct active neurons and the missing ones among them; no state changes before the capacity check.
  thread_local std::vector<uint8_t> seen;
  if (static_cast<int64_t>(seen.size()) < n_neurons) seen.resize(n_neurons, 0);
  int64_t n_distinct = 0;
  for (int64_t i = 0; i < k; ++i) {
    n_distinct += !seen[ids[i]];
    seen[ids[i]] = 1;
  }
  // The missing ids go to `missing` (capacity entries) only once they are known to fit.
  const bool fits = n_distinct <= capacity;
  int64_t n_missing = 0;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t id = ids[i];
    if (fits && seen[id] && slots[id] < 0) miss[n_missing++] = id;
    seen[id] = 0;
  }
  TORCH_CHECK(fits, "cache_plan: the token has ", n_distinct, " distinct active neurons but the cache holds ", capacity,
              " rows; raise the byte budget");
  for (int64_t i = 0; i < k; ++i) last[ids[i]] = step;
  // Rows whose neuron was not active in the last `window` tokens (steps step-window+1 .. step) leave.
  int64_t n_window = 0;
  for (int64_t i = 0; i < num_used; ++i)
    if (last[ptr[i]] <= step - window) evict[n_window++] = i;
  // Budget: when the window's union does not fit, the least recently active rows not needed now leave too.
  const int64_t over = (num_used - n_window) + n_missing - capacity;
  int64_t n_budget = 0;
  if (over > 0) {
    thread_local std::vector<std::pair<int64_t, int64_t>> candidates;  // (last active step, row)
    candidates.clear();
    for (int64_t i = 0; i < num_used; ++i) {
      const int64_t when = last[ptr[i]];
      if (when > step - window && when != step) candidates.emplace_back(when, i);
    }
    // n_distinct <= capacity guarantees enough candidates.
    std::nth_element(candidates.begin(), candidates.begin() + (over - 1), candidates.end());
    for (int64_t j = 0; j < over; ++j) evict[n_window + j] = candidates[j].second;
    n_budget = over;
  }
  return {c10::SymInt(n_window), c10::SymInt(n_budget), c10::SymInt(n_missing)};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashllm, CPU, m) {
  m.impl("cache_plan", &cache_plan_cpu);
}

}  // namespace flashllm
