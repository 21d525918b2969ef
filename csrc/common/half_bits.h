// Float bits of half and bfloat16 storage, for kernels that keep 16-bit elements as uint16_t: hardware conversion
// on a GPU, an exact software one when a body runs on the CPU SIMT emulation (every half is a float). Storage<KIND>
// and to_float<KIND> serve the GPU kernels that compute on float32, float16 or bfloat16 elements (FfnKind).
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "common/ffn_grid.h"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define FLASHLLM_CONVERT __device__ __forceinline__
#else
#define FLASHLLM_CONVERT inline
#endif

namespace flashllm::ffn_detail {

FLASHLLM_CONVERT float bits_to_float(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, 4);
  return f;
#endif
}

// IEEE half to float; in the emulation a software conversion (exact: every half is a float).
FLASHLLM_CONVERT float half_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1fu) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf, nan
  if (exp == 0) {
    if (man == 0) return bits_to_float(sign);
    int shift = 0;  // subnormal: normalise
    while (!(man & 0x400u)) man <<= 1, ++shift;
    return bits_to_float(sign | (uint32_t(113 - shift) << 23) | ((man & 0x3ffu) << 13));
  }
  return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
#endif
}

template <int KIND>
using Storage = typename std::conditional<KIND == kFfnF32, float, uint16_t>::type;

template <int KIND>
FLASHLLM_CONVERT float to_float(Storage<KIND> v) {
  if constexpr (KIND == kFfnF32)
    return v;
  else if constexpr (KIND == kFfnF16)
    return half_to_float(v);
  else
    return bits_to_float(uint32_t(v) << 16);
}

}  // namespace flashllm::ffn_detail
