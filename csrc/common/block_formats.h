// GGUF's block types as the native code names them (flashllm_ext/ops/blocks.py: BLOCK_FORMATS): the codes the ops
// take and each block's bytes. Plain C++, no torch or CUDA headers: the CPU kernels and the GPU kernel bodies share it.
#pragma once
#include <cstdint>
#include <type_traits>

namespace flashllm {

enum BlockFormatCode : int { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };
constexpr int64_t kBlock = 32;  // weights per block

// Bytes of one block: its float16 scale d (and Q4_1's float16 minimum m), then its codes.
template <int FMT>
constexpr int kBlockBytes = FMT == kQ8_0   ? 34
                            : FMT == kQ4_0 ? 18
                                           : 20;

inline int64_t block_bytes(int format) {
  return format == kQ8_0 ? kBlockBytes<kQ8_0> : format == kQ4_0 ? kBlockBytes<kQ4_0> : kBlockBytes<kQ4_1>;
}

inline bool is_block_format(int format) {
  return format == kQ8_0 || format == kQ4_0 || format == kQ4_1;
}

// f(std::integral_constant<int, FMT>{}) for the block format code `format` (is_block_format: callers check): what
// each per-format template is picked by.
template <class F>
decltype(auto) with_block_format(int format, F&& f) {
  if (format == kQ8_0) return f(std::integral_constant<int, kQ8_0>{});
  if (format == kQ4_0) return f(std::integral_constant<int, kQ4_0>{});
  return f(std::integral_constant<int, kQ4_1>{});
}

}  // namespace flashllm
