// Metal's half and bfloat16_t as far as the kernel bodies run over the SIMT emulation use them: storage bits read as
// float.
#pragma once
#include <cstdint>

#include "common/half_bits.h"

namespace flashllm::simt_bodies {

struct half {
  uint16_t bits;
  explicit operator float() const { return ffn_detail::half_to_float(bits); }
};
struct bfloat16_t {
  uint16_t bits;
  explicit operator float() const { return ffn_detail::bits_to_float(uint32_t(bits) << 16); }
};

}  // namespace flashllm::simt_bodies
