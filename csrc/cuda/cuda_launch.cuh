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

  // How many blocks of `kernel` at block_threads threads the current device runs at once (every SM full), or 0
  // when the runtime cannot say (its error is cleared, so the launch that follows reports its own).
  template <class... Params>
  long long resident_blocks(void (*kernel)(Params...), int block_threads) const {
    int device = 0, sms = 0, per_sm = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, block_threads, 0) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return static_cast<long long>(sms) * per_sm;
  }
};

}  // namespace flashllm
