// The row moves of a swap-delete (flashllm::cache_compact), shared by the CPU kernel and the CUDA kernel body.
//
// Deleting c distinct rows `rows` from the first n used rows leaves n' = n - c rows. The holes are the deleted rows
// below n'; the survivors at or past n' fill them. Both sides are taken in ascending order, so with `sorted` the
// deleted rows sorted ascending and h = the number of them below n' (a prefix of `sorted`):
//   survivor j (n' <= j < n, not deleted) is the k-th survivor, k = (j - n') - (deleted rows in [n', j)),
//   and the deleted rows in [n', j) number lower_bound(sorted, j) - h; it moves into hole sorted[k].
// Each survivor finds its hole independently (a binary search), which is what lets a GPU thread per row do it.
#pragma once
#include <cstdint>

#ifndef __CUDACC__
#define FLASHLLM_HD
#else
#define FLASHLLM_HD __host__ __device__
#endif

namespace flashllm {

// First position in sorted[0, c) whose value is >= v.
FLASHLLM_HD inline int64_t lower_bound_i64(const int64_t* sorted, int64_t c, int64_t v) {
  int64_t lo = 0, hi = c;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (sorted[mid] < v)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// The hole survivor row j moves into, or -1 when j is itself deleted. n_new = n - c, holes = deleted rows < n_new.
// On rows nobody checked (the CUDA kernel without kernel checks: a row repeated or outside [0, n)), the position or
// the hole may fall outside sorted or [0, n_new): -1 then too, so no caller reads or writes out of bounds.
FLASHLLM_HD inline int64_t compaction_hole(const int64_t* sorted, int64_t c, int64_t holes, int64_t n_new, int64_t j) {
  const int64_t below = lower_bound_i64(sorted, c, j);
  if (below < c && sorted[below] == j) return -1;
  const int64_t k = (j - n_new) - (below - holes);
  if (k < 0 || k >= c) return -1;
  return sorted[k] >= 0 && sorted[k] < n_new ? sorted[k] : -1;
}

}  // namespace flashllm
