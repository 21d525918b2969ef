// Token groups of the CPU kernels that multiply a weight by T tokens at once: the per-token accumulators of up to
// kCpuMaxTokens tokens live in registers, so the kernels are templated on the group size and larger T runs in groups.
#pragma once
#include <type_traits>

namespace flashllm {

constexpr int kCpuMaxTokens = 8;

// Calls f(std::integral_constant<int, n>{}) for n in [1, kCpuMaxTokens] (larger n is clamped).
template <class F>
void with_tokens(int n, F&& f) {
  switch (n) {
    case 1:
      return f(std::integral_constant<int, 1>{});
    case 2:
      return f(std::integral_constant<int, 2>{});
    case 3:
      return f(std::integral_constant<int, 3>{});
    case 4:
      return f(std::integral_constant<int, 4>{});
    case 5:
      return f(std::integral_constant<int, 5>{});
    case 6:
      return f(std::integral_constant<int, 6>{});
    case 7:
      return f(std::integral_constant<int, 7>{});
    default:
      return f(std::integral_constant<int, kCpuMaxTokens>{});
  }
}

}  // namespace flashllm
