#include "common/cpu_isa.h"

#include <atomic>
#include <stdexcept>

namespace flashllm {
namespace {

CpuIsa detect() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  // libgcc's checks include the OS state (XCR0) for the AVX and AVX-512 registers.
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("popcnt");
  if (avx512 && __builtin_cpu_supports("avx512vbmi2")) return CpuIsa::kAvx512Vbmi2;
  if (avx512) return CpuIsa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt")) return CpuIsa::kAvx2;
#endif
  return CpuIsa::kScalar;
}

std::atomic<int> forced{-1};

}  // namespace

CpuIsa detected_cpu_isa() {
  static const CpuIsa isa = detect();
  return isa;
}

CpuIsa active_cpu_isa() {
  const int f = forced.load(std::memory_order_relaxed);
  return f < 0 ? detected_cpu_isa() : static_cast<CpuIsa>(f);
}

void force_cpu_isa(CpuIsa isa) {
  if (static_cast<int>(isa) > static_cast<int>(detected_cpu_isa())) {
    throw std::invalid_argument(std::string("this CPU does not support ") + cpu_isa_name(isa) +
                                " (best: " + cpu_isa_name(detected_cpu_isa()) + ")");
  }
  forced.store(static_cast<int>(isa), std::memory_order_relaxed);
}

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512Vbmi2: return "avx512vbmi2";
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

CpuIsa cpu_isa_from_name(const std::string& name) {
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Vbmi2}) {
    if (name == cpu_isa_name(isa)) return isa;
  }
  throw std::invalid_argument("unknown CPU ISA '" + name + "' (scalar, avx2, avx512, avx512vbmi2)");
}

}  // namespace flashllm
