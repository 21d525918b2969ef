// torch.ops.flashllm_simt.* kernels that test the SIMT emulation itself (tests/ops/test_simt.py compares them with
// scalar models): every warp/SIMD intrinsic, barriers and block-shared memory, and the misuse it must report.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <chrono>
#include <string>
#include <thread>

#include "simt/simt_metal.h"

namespace flashllm {
namespace {

template <class T>
T apply_cuda_intrinsic(const std::string& name, T x, int64_t param, unsigned mask, int width) {
  if (name == "shfl") return __shfl_sync(mask, x, int(param), width);
  if (name == "shfl_up") return __shfl_up_sync(mask, x, unsigned(param), width);
  if (name == "shfl_down") return __shfl_down_sync(mask, x, unsigned(param), width);
  if (name == "shfl_xor") return __shfl_xor_sync(mask, x, int(param), width);
  if (name == "ballot") return T(__ballot_sync(mask, x != T(0)));
  if (name == "syncwarp") {
    __syncwarp(mask);
    return x;
  }
  if constexpr (std::is_integral<T>::value) {
    if (name == "popc") return T(__popc(unsigned(x)));
    if (name == "popcll") return T(__popcll(static_cast<unsigned long long>(x)));
  }
  throw std::invalid_argument("unknown CUDA intrinsic " + name);
}

template <class T>
T apply_metal_intrinsic(const std::string& name, T x, int64_t param) {
  using namespace metal;
  if (name == "simd_sum") return simd_sum(x);
  if (name == "simd_max") return simd_max(x);
  if (name == "simd_prefix_exclusive_sum") return simd_prefix_exclusive_sum(x);
  if (name == "simd_prefix_inclusive_sum") return simd_prefix_inclusive_sum(x);
  if (name == "simd_shuffle") return simd_shuffle(x, ushort(param));
  if (name == "simd_shuffle_up") return simd_shuffle_up(x, ushort(param));
  if (name == "simd_shuffle_down") return simd_shuffle_down(x, ushort(param));
  if (name == "simd_shuffle_xor") return simd_shuffle_xor(x, ushort(param));
  if (name == "simd_ballot") return T(simd_vote::vote_t(simd_ballot(x != T(0))));
  if constexpr (std::is_integral<T>::value) {
    if (name == "popcount") return popcount(x);
  }
  throw std::invalid_argument("unknown Metal intrinsic " + name);
}

// Runs f(tensor element type) for the dtypes the intrinsic tests use.
template <class F>
void for_dtype(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kInt:
      return f(int32_t{});
    case at::kLong:
      return f(int64_t{});
    case at::kFloat:
      return f(float{});
    default:
      TORCH_CHECK(false, "intrinsic tests take int32, int64 or float32 values, got ", t);
  }
}

void check_lane_inputs(const at::Tensor& x, const at::Tensor& param) {
  TORCH_CHECK(x.dim() == 1 && x.is_contiguous() && x.device().is_cpu(), "x must be a contiguous 1-D CPU tensor");
  TORCH_CHECK(param.scalar_type() == at::kLong && param.sizes() == x.sizes() && param.is_contiguous(),
              "param must be a contiguous int64 tensor shaped like x");
}

template <class F>
void rethrow_as_torch(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what());
  }
}

// One block of x.numel() threads; lanes named in `mask` call the intrinsic with their x and param, the others keep x.
at::Tensor cuda_intrinsic(const std::string& name, const at::Tensor& x, const at::Tensor& param, int64_t mask,
                          int64_t width) {
  check_lane_inputs(x, param);
  at::Tensor out = x.clone();
  for_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xs = x.data_ptr<T>();
    const int64_t* ps = param.data_ptr<int64_t>();
    T* os = out.data_ptr<T>();
    rethrow_as_torch([&] {
      simt::launch(dim3(1), dim3(unsigned(x.numel())), [&] {
        const unsigned t = threadIdx.x;
        if (uint64_t(mask) >> (t % 32) & 1)
          os[t] = apply_cuda_intrinsic<T>(name, xs[t], ps[t], unsigned(mask), int(width));
      });
    });
  });
  return out;
}

// dispatch_threads over `grid` threads in threadgroups of `threadgroup`; out[i] for thread i (others stay 0).
at::Tensor metal_intrinsic(const std::string& name, const at::Tensor& x, const at::Tensor& param, int64_t grid,
                           int64_t threadgroup) {
  check_lane_inputs(x, param);
  TORCH_CHECK(grid <= x.numel(), "grid larger than x");
  at::Tensor out = at::zeros_like(x);
  for_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xs = x.data_ptr<T>();
    const int64_t* ps = param.data_ptr<int64_t>();
    T* os = out.data_ptr<T>();
    rethrow_as_torch([&] {
      simt::dispatch_threads(uint3{unsigned(grid), 1, 1}, uint3{unsigned(threadgroup), 1, 1},
                             [&](const simt::MetalThread& t) {
                               const unsigned i = t.thread_position_in_grid.x;
                               os[i] = apply_metal_intrinsic<T>(name, xs[i], ps[i]);
                             });
    });
  });
  return out;
}

// out[b, t, r] = what thread t of block b read, after a barrier, from the block-shared slot its neighbour wrote in
// round r. Thread 0 writes late, so a barrier that lets anyone through early shows. Threads >= n_active return
// before the first barrier.
at::Tensor barrier_rounds(int64_t n_blocks, int64_t n_threads, int64_t n_active, int64_t rounds, bool metal_api) {
  TORCH_CHECK(n_threads <= 1024 && n_active > 0 && n_active <= n_threads, "bad barrier test shape");
  at::Tensor out = at::full({n_blocks, n_threads, rounds}, -1, at::kLong);
  int64_t* os = out.data_ptr<int64_t>();
  auto round_trip = [&](unsigned blk, unsigned tid, auto&& barrier, int64_t* slot) {
    if (tid >= n_active) return;
    for (int64_t r = 0; r < rounds; ++r) {
      if (tid == 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      slot[tid] = int64_t(blk) * 1000000 + r * 1000 + tid;
      barrier();
      os[(int64_t(blk) * n_threads + tid) * rounds + r] = slot[(tid + 1) % n_active];
      barrier();
    }
  };
  rethrow_as_torch([&] {
    if (metal_api) {
      simt::dispatch_threads(uint3{unsigned(n_blocks * n_threads), 1, 1}, uint3{unsigned(n_threads), 1, 1},
                             [&](const simt::MetalThread& t) {
                               static int64_t slot[1024];  // what `threadgroup int64_t slot[1024];` becomes
                               round_trip(
                                   t.threadgroup_position_in_grid.x, t.thread_index_in_threadgroup,
                                   [] { metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup); }, slot);
                             });
    } else {
      simt::launch(dim3(unsigned(n_blocks)), dim3(unsigned(n_threads)), [&] {
        __shared__ int64_t slot[1024];
        round_trip(blockIdx.x, threadIdx.x, [] { __syncthreads(); }, slot);
      });
    }
  });
  return out;
}

// The misaligned vector store the emulation must refuse, as a GPU faults on it. A uint4 member call on a misaligned
// address is undefined in C++, which is the point here: UBSan's alignment check is off for this function so that the
// emulation's own check (check_vector_aligned in simt.h) is the one under test.
__attribute__((no_sanitize("alignment"))) void store_misaligned_uint4(unsigned char* buf, unsigned offset) {
  *reinterpret_cast<uint4*>(buf + offset) = make_uint4(1, 2, 3, 4);
}

// Kernels that misuse the model; each must make the launch fail with a message naming the problem.
void misuse(const std::string& what) {
  rethrow_as_torch([&] {
    simt::launch(dim3(1), dim3(64), [&] {
      const unsigned lane = threadIdx.x % 32;
      if (what == "divergent_intrinsics") {
        if (lane < 16)
          __shfl_sync(0xffffffffu, 1, 0);
        else
          __ballot_sync(0xffffffffu, 1);
      } else if (what == "exit_in_mask") {
        if (lane != 5) __shfl_sync(0xffffffffu, 1, 0);
      } else if (what == "barrier_in_divergent_warp") {
        if (lane == 0)
          __syncthreads();
        else
          __syncwarp();
      } else if (what == "shuffle_outside_mask") {
        if (lane < 2) __shfl_sync(0x3u, 1, 7);
      } else if (what == "mask_without_caller") {
        if (lane == 0) __shfl_sync(0x2u, 1, 1);
      } else if (what == "misaligned_vector_store") {
        alignas(16) unsigned char buf[32] = {};
        store_misaligned_uint4(buf, 4 * (threadIdx.x % 2));
      } else if (what == "kernel_throws") {
        if (threadIdx.x == 40) throw std::out_of_range("index 99 past the end");
        __syncthreads();
      } else {
        throw std::invalid_argument("unknown misuse " + what);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flashllm_simt, m) {
  m.def("cuda_intrinsic(str name, Tensor x, Tensor param, int mask, int width) -> Tensor", &cuda_intrinsic);
  m.def("metal_intrinsic(str name, Tensor x, Tensor param, int grid, int threadgroup) -> Tensor", &metal_intrinsic);
  m.def("barrier_rounds(int n_blocks, int n_threads, int n_active, int rounds, bool metal) -> Tensor", &barrier_rounds);
  m.def("misuse(str what) -> ()", &misuse);
}

}  // namespace flashllm
