#include "common/cpu_isa.h"

#include <atomic>
#include <iterator>
#include <set>
#include <stdexcept>
#include <string>

namespace flashllm {
namespace {

// Every feature a path's kernels are compiled with, and the lowest path that needs it: the target attributes in
// csrc/cpu/*.cpp (sparse_ffn: "avx2,fma,f16c" and "avx512f,avx512bw,avx512vl,fma,f16c"; endor_decompress:
// "avx2,popcnt", "avx512f,avx512bw,avx512vl,popcnt" and "+avx512vbmi2"; quant_scores: "+avx512vnni", and
// "+avx512vbmi" at the VBMI2 level: every CPU with VBMI2 has VBMI, this only makes it explicit; endor_linear:
// "+avx512bf16"). A path needs the features of every path below it too (a kernel with no code of its own at one
// level runs the level below), so a CPU or VM that masks FMA or F16C gets the scalar path rather than SIGILL. One
// list, used both to probe the CPU and to decide.
// clang-format off: an X-macro list, one feature a line
#define FLASHLLM_CPU_FEATURES(X) \
  X("avx2", kAvx2) \
  X("fma", kAvx2) \
  X("f16c", kAvx2) \
  X("popcnt", kAvx2) \
  X("avx512f", kAvx512) \
  X("avx512bw", kAvx512) \
  X("avx512vl", kAvx512) \
  X("avx512vnni", kAvx512Vnni) \
  X("avx512vbmi", kAvx512Vbmi2) \
  X("avx512vbmi2", kAvx512Vbmi2) \
  X("avx512bf16", kAvx512Bf16)
// clang-format on

struct CpuFeature {
  const char* name;
  CpuIsa needed_from;
};

#define FLASHLLM_FEATURE_ENTRY(name, isa) CpuFeature{name, CpuIsa::isa},
constexpr CpuFeature kCpuFeatures[] = {FLASHLLM_CPU_FEATURES(FLASHLLM_FEATURE_ENTRY)};
#undef FLASHLLM_FEATURE_ENTRY

std::set<std::string> supported_features() {
  std::set<std::string> supported;
#if defined(__x86_64__)
  __builtin_cpu_init();
  // __builtin_cpu_supports takes only string literals, hence the macro. libgcc's answers include the OS state
  // (XCR0) for the AVX and AVX-512 registers: FMA and F16C count as absent where the OS does not save YMM.
#define FLASHLLM_PROBE(name, isa) \
  if (__builtin_cpu_supports(name)) supported.insert(name);
  FLASHLLM_CPU_FEATURES(FLASHLLM_PROBE)
#undef FLASHLLM_PROBE
#endif
  return supported;
}
#undef FLASHLLM_CPU_FEATURES

std::atomic<int> forced{-1};

}  // namespace

CpuIsa isa_for_features(const std::set<std::string>& features) {
  CpuIsa best = kCpuIsas[std::size(kCpuIsas) - 1];
  for (const CpuFeature& f : kCpuFeatures) {
    // A missing feature caps the choice just below the lowest path compiled with it.
    if (!features.count(f.name) && f.needed_from <= best) {
      best = static_cast<CpuIsa>(static_cast<int>(f.needed_from) - 1);
    }
  }
  return best;
}

CpuIsa detected_cpu_isa() {
  static const CpuIsa isa = isa_for_features(supported_features());
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
    case CpuIsa::kAvx512Bf16:
      return "avx512bf16";
    case CpuIsa::kAvx512Vbmi2:
      return "avx512vbmi2";
    case CpuIsa::kAvx512Vnni:
      return "avx512vnni";
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx2:
      return "avx2";
    default:
      return "scalar";
  }
}

CpuIsa cpu_isa_from_name(const std::string& name) {
  std::string known;
  for (CpuIsa isa : kCpuIsas) {
    if (name == cpu_isa_name(isa)) return isa;
    known += (known.empty() ? "" : ", ") + std::string(cpu_isa_name(isa));
  }
  throw std::invalid_argument("unknown CPU ISA '" + name + "' (" + known + ")");
}

}  // namespace flashllm
