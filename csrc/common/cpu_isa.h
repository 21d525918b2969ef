// Runtime choice of the CPU instruction set. Kernels are compiled for every ISA with function-level target
// attributes and pick one at call time, so one binary runs on any x86-64 CPU (and tests can force each path).
#pragma once
#include <set>
#include <string>

namespace flashllm {

// Ordered: each level needs every feature of the levels below it. VNNI sits below VBMI2 because every CPU with
// VBMI2 (Ice Lake and later, Zen 4) has VNNI, while Cascade Lake has VNNI without VBMI2. BF16 sits above VBMI2: the
// CPUs with both (Sapphire Rapids, Zen 4) get it; Cooper Lake (BF16 without VBMI2) runs the VNNI level, Ice Lake
// (VBMI2 without BF16) the VBMI2 level.
enum class CpuIsa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3, kAvx512Vbmi2 = 4, kAvx512Bf16 = 5 };
inline constexpr CpuIsa kCpuIsas[] = {CpuIsa::kScalar,     CpuIsa::kAvx2,        CpuIsa::kAvx512,
                                      CpuIsa::kAvx512Vnni, CpuIsa::kAvx512Vbmi2, CpuIsa::kAvx512Bf16};  // lowest first

CpuIsa detected_cpu_isa();       // best ISA this CPU and OS support
CpuIsa active_cpu_isa();         // what kernels use now: detected, or lower if forced
void force_cpu_isa(CpuIsa isa);  // throws std::invalid_argument above the detected ISA
const char* cpu_isa_name(CpuIsa isa);
CpuIsa cpu_isa_from_name(const std::string& name);  // throws std::invalid_argument on an unknown name

// The best path for a CPU with `features` (GCC target names: "avx2", "fma", "f16c", "avx512vnni", ...): the
// highest ISA whose kernels' every compiled-with feature, and every lower ISA's, is present. detected_cpu_isa()
// is this function of what the CPU and OS report; tests call it on made-up feature sets.
CpuIsa isa_for_features(const std::set<std::string>& features);

}  // namespace flashllm
