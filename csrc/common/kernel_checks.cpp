#include "common/kernel_checks.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace flashllm {
namespace {

std::atomic<bool>& kernel_checks() {
  static std::atomic<bool> enabled{[] {
    const char* env = std::getenv("FLASHLLM_CHECK_KERNELS");
    return env != nullptr && std::strcmp(env, "1") == 0;
  }()};
  return enabled;
}

}  // namespace

bool kernel_checks_enabled() {
  return kernel_checks().load(std::memory_order_relaxed);
}

void set_kernel_checks(bool enabled) {
  kernel_checks().store(enabled, std::memory_order_relaxed);
}

}  // namespace flashllm
