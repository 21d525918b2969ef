// The launch policy the shipped launchers (the launch_* templates of csrc/cuda/*_kernel.cuh) are instantiated with
// in the CUDA build; simt::EmulatedLaunch (csrc/simt/simt.h) is the other, so the SIMT tests run the same launch
// code. Only nvcc compiles this file.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace flashllm {

struct CudaLaunch {
  cudaStream_t stream;

  // Launches kernel<<<grid, block>>> on `stream` and returns the launch's error, so a bad configuration surfaces
  // at the launch that caused it. No dynamic shared memory: no kernel here uses it (nor can the emulation).
  template <class... Params, class... Args>
  cudaError_t operator()(void (*kernel)(Params...), dim3 grid, dim3 block, const Args&... args) const {
    kernel<<<grid, block, 0, stream>>>(args...);
    return cudaGetLastError();
  }

  cudaError_t fill_bytes(void* dst, int value, std::size_t bytes) const {
    return cudaMemsetAsync(dst, value, bytes, stream);
  }
};

}  // namespace flashllm
