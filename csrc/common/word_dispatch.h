// Kernels that only move elements (never do arithmetic on them) are templated on an unsigned word as wide as the
// element, not on the dtype: one instantiation serves fp16 and bf16, and NaN payloads survive. No torch headers:
// CUDA launchers include this too.
#pragma once
#include <cstdint>
#include <stdexcept>

namespace flashllm {

// Calls fn(W{}) with W = uint8_t, uint16_t or uint32_t for 1-, 2- or 4-byte elements.
template <class Fn>
decltype(auto) dispatch_word(int64_t elem_bytes, Fn&& fn) {
  switch (elem_bytes) {
    case 1:
      return fn(uint8_t{});
    case 2:
      return fn(uint16_t{});
    case 4:
      return fn(uint32_t{});
    default:
      throw std::invalid_argument("element size must be 1, 2 or 4 bytes");
  }
}

}  // namespace flashllm
