// CPU SIMT emulation: compiles a CUDA kernel body as plain C++ and runs it on the CPU (tests only).
//
// Model:
//   * One launch runs the blocks of its grid one after another. The threads of a block are real std::threads
//     (one per CUDA thread, created once per launch and reused for every block), so a kernel that needs a barrier
//     to be correct fails here as it would on a GPU, instead of passing by sequential luck.
//   * __shared__ expands to `static`: the blocks of a launch run one at a time and launches are serialised by a
//     process-wide mutex, so a static local is exactly "one copy per running block". Dynamic (extern) shared
//     memory is not supported.
//   * Warps are 32 consecutive threads of a block. Warp intrinsics are collective: every lane named in the mask
//     must call the same intrinsic with the same mask, the round completes when all have arrived, and each lane
//     then gets the result a GPU would give. Lanes that disagree (different intrinsic, different mask, a mask
//     naming an exited lane, a shuffle reading a lane outside the mask) make the launch fail with a message, as
//     does a deadlock (every live thread of the block waiting) and any exception the kernel throws.
//   * A thread that returns early no longer counts for __syncthreads (what GPUs do in practice).
//   * Every collective and barrier takes one block-wide mutex, which also makes memory written before it visible
//     after it (at least the ordering CUDA guarantees).
//
// Metal's threadgroup/simdgroup model is the same machinery; see simt_metal.h.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

struct uint3 {
  unsigned x, y, z;
};

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace simt::detail {
// A GPU faults on a misaligned vector access; the emulation reports it instead of letting x86 get away with it.
inline void check_vector_aligned(const void* p, std::size_t align, const char* what) {
  if (reinterpret_cast<std::uintptr_t>(p) % align != 0)
    throw std::runtime_error(std::string("misaligned ") + std::to_string(align) + "-byte vector " + what);
}
}  // namespace simt::detail

// CUDA's vector types; copying one through a pointer is a vector load or store, so it checks alignment.
#define SIMT_VECTOR_TYPE(NAME, N, ...)                          \
  struct alignas(N * 4) NAME {                                  \
    unsigned __VA_ARGS__;                                       \
    NAME() = default;                                           \
    NAME(const NAME& o) {                                       \
      simt::detail::check_vector_aligned(&o, N * 4, "load");    \
      std::memcpy(static_cast<void*>(this), &o, N * 4);         \
    }                                                           \
    NAME& operator=(const NAME& o) {                            \
      simt::detail::check_vector_aligned(this, N * 4, "store"); \
      std::memcpy(static_cast<void*>(this), &o, N * 4);         \
      return *this;                                             \
    }                                                           \
  };
SIMT_VECTOR_TYPE(uint2, 2, x, y)
SIMT_VECTOR_TYPE(uint4, 4, x, y, z, w)
#undef SIMT_VECTOR_TYPE
inline uint2 make_uint2(unsigned x, unsigned y) {
  uint2 v;
  v.x = x, v.y = y;
  return v;
}
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) {
  uint4 v;
  v.x = x, v.y = y, v.z = z, v.w = w;
  return v;
}

// The CUDA runtime's status codes the launchers return (the few they use).
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1 };

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

constexpr int warpSize = 32;

inline thread_local uint3 threadIdx{0, 0, 0};
inline thread_local uint3 blockIdx{0, 0, 0};
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

namespace simt {

// Raised by simt::launch when a kernel misbehaves (message says how) or throws.
struct LaunchError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace detail {

constexpr int kWarp = 32;

// Thrown inside emulated threads to unwind them once the launch has failed.
struct Abort {};

// Computes one lane's result of a warp collective from every lane's deposited value and parameter.
using CollectiveFn = uint64_t (*)(const uint64_t* vals, const int64_t* params, uint32_t members, int lane);

struct Warp {
  std::condition_variable cv;
  uint32_t present = 0;  // lanes that exist in this block
  uint32_t exited = 0;
  // The open round, if any.
  uint32_t arrived = 0;
  uint32_t mask = 0;           // lanes named by the round (explicit_mask) ...
  bool explicit_mask = false;  // ... or, for Metal SIMD ops, whichever lanes are still running
  CollectiveFn fn = nullptr;
  const char* name = nullptr;
  uint64_t generation = 0;
  uint64_t vals[kWarp] = {};
  int64_t params[kWarp] = {};
  uint64_t results[kWarp] = {};
};

struct Block {
  std::mutex m;
  std::condition_variable cv;  // __syncthreads rounds and block completion
  std::vector<std::unique_ptr<Warp>> warps;
  unsigned n_threads = 0;
  unsigned live = 0;     // threads of the current block still running the kernel
  unsigned waiting = 0;  // live threads blocked in a barrier or collective that has not completed
  unsigned bar_arrived = 0;
  uint64_t bar_generation = 0;
  unsigned finished = 0;
  uint64_t block_generation = 0;
  bool aborted = false;
  std::string error;

  explicit Block(unsigned n) : n_threads(n) {
    for (unsigned w = 0; w < (n + kWarp - 1) / kWarp; ++w) warps.emplace_back(new Warp);
  }
};

struct ThreadCtx {
  Block* block = nullptr;
  unsigned tid = 0;  // linear index in the block
};

inline thread_local ThreadCtx tls;

inline std::mutex& launch_mutex() {
  static std::mutex m;
  return m;
}

// Records the first failure, wakes everyone, unwinds the caller. Requires the block lock.
[[noreturn]] inline void fail_locked(Block& b, const std::string& msg) {
  if (!b.aborted) {
    b.aborted = true;
    b.error = msg;
  }
  b.cv.notify_all();
  for (auto& w : b.warps) w->cv.notify_all();
  throw Abort{};
}

inline std::string thread_name(unsigned tid) {
  return "thread " + std::to_string(tid) + " (warp " + std::to_string(tid / kWarp) + ", lane " +
         std::to_string(tid % kWarp) + ") of block (" + std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) +
         "," + std::to_string(blockIdx.z) + ")";
}

// Blocks the calling thread until `done` holds, with deadlock detection. Requires the block lock.
template <class Pred>
void wait_locked(Block& b, std::unique_lock<std::mutex>& lock, std::condition_variable& cv, const char* what,
                 Pred done) {
  ++b.waiting;
  if (b.waiting == b.live)
    fail_locked(b, std::string("deadlock: every running thread of the block waits, the last in ") + what + " (" +
                       thread_name(tls.tid) + ")");
  cv.wait(lock, [&] { return b.aborted || done(); });
  if (b.aborted) throw Abort{};
}

inline uint32_t running_lanes(const Warp& w) {
  return w.present & ~w.exited;
}

// Completes the warp's open round if every member has arrived; `caller_arrived` says whether the calling thread is
// one of the arrivals (it is not blocked, the others are). Requires the block lock.
inline void try_complete_round(Block& b, Warp& w, bool caller_arrived) {
  if (w.arrived == 0) return;
  const uint32_t members = w.explicit_mask ? w.mask : running_lanes(w);
  if ((w.arrived & members) != members) return;
  for (int lane = 0; lane < kWarp; ++lane)
    if (members >> lane & 1) w.results[lane] = w.fn(w.vals, w.params, members, lane);
  b.waiting -= __builtin_popcount(w.arrived) - (caller_arrived ? 1 : 0);
  w.arrived = 0;
  ++w.generation;
  w.cv.notify_all();
}

inline void try_complete_barrier(Block& b, bool caller_arrived) {
  if (b.bar_arrived == 0 || b.bar_arrived != b.live) return;
  b.waiting -= b.bar_arrived - (caller_arrived ? 1 : 0);
  b.bar_arrived = 0;
  ++b.bar_generation;
  b.cv.notify_all();
}

// One lane's part in a warp collective. `mask` is ignored when explicit_mask is false (Metal: all running lanes).
inline uint64_t collective(const char* name, CollectiveFn fn, bool explicit_mask, uint32_t mask, uint64_t val,
                           int64_t param) {
  Block& b = *tls.block;
  Warp& w = *b.warps[tls.tid / kWarp];
  const int lane = tls.tid % kWarp;
  std::unique_lock<std::mutex> lock(b.m);
  if (b.aborted) throw Abort{};
  if (explicit_mask) {
    mask &= w.present;
    if (!(mask >> lane & 1))
      fail_locked(b, std::string(name) + ": mask does not name the calling lane (" + thread_name(tls.tid) + ")");
    if (mask & w.exited)
      fail_locked(b, std::string(name) + ": mask names a lane that has exited (" + thread_name(tls.tid) + ")");
  }
  if (w.arrived == 0) {
    w.fn = fn;
    w.name = name;
    w.mask = mask;
    w.explicit_mask = explicit_mask;
  } else if (w.fn != fn || w.explicit_mask != explicit_mask || (explicit_mask && w.mask != mask)) {
    fail_locked(b, std::string("warp divergence: ") + thread_name(tls.tid) + " calls " + name +
                       " while its warp waits in " + w.name + " (or with another mask)");
  }
  w.vals[lane] = val;
  w.params[lane] = param;
  w.arrived |= 1u << lane;
  const uint64_t my_generation = w.generation;
  try_complete_round(b, w, true);
  if (w.generation == my_generation) wait_locked(b, lock, w.cv, name, [&] { return w.generation != my_generation; });
  return w.results[lane];
}

inline void syncthreads() {
  Block& b = *tls.block;
  std::unique_lock<std::mutex> lock(b.m);
  if (b.aborted) throw Abort{};
  const Warp& w = *b.warps[tls.tid / kWarp];
  const uint32_t bit = 1u << (tls.tid % kWarp);
  if (w.arrived && ((w.explicit_mask ? w.mask : running_lanes(w)) & bit) && !(w.arrived & bit))
    fail_locked(
        b, "__syncthreads: " + thread_name(tls.tid) + " reached the barrier while its warp waits for it in " + w.name);
  ++b.bar_arrived;
  const uint64_t my_generation = b.bar_generation;
  try_complete_barrier(b, true);
  if (b.bar_generation == my_generation)
    wait_locked(b, lock, b.cv, "__syncthreads", [&] { return b.bar_generation != my_generation; });
}

// The calling thread has returned from the kernel (or does not exist in this block).
inline void exit_thread_locked(Block& b, unsigned tid, bool existed) {
  Warp& w = *b.warps[tid / kWarp];
  const uint32_t bit = 1u << (tid % kWarp);
  if (existed) {
    --b.live;
    w.exited |= bit;
    if (w.arrived && w.explicit_mask && (w.mask & bit))
      fail_locked(b, thread_name(tid) + " exited while lanes of its warp wait for it in " + w.name);
    try_complete_round(b, w, false);
    try_complete_barrier(b, false);
    if (b.live > 0 && b.waiting == b.live)
      fail_locked(b, "deadlock: " + thread_name(tid) + " exited and every remaining thread of the block waits");
  }
}

template <class Exists>
void prepare_block(Block& b, uint64_t block_linear, Exists&& exists) {
  b.live = 0;
  b.waiting = 0;
  b.bar_arrived = 0;
  b.finished = 0;
  for (auto& w : b.warps) {
    w->present = 0;
    w->exited = 0;
    w->arrived = 0;
  }
  for (unsigned t = 0; t < b.n_threads; ++t) {
    if (exists(block_linear, t)) {
      ++b.live;
      b.warps[t / kWarp]->present |= 1u << (t % kWarp);
    }
  }
}

// Runs body(block_linear, tid) for every existing thread of every block, blocks in order. `exists` says which
// (block, thread) slots are real: Metal's non-uniform threadgroups leave some out.
template <class Body, class Exists>
void run_blocks(uint64_t n_blocks, unsigned n_threads, Body&& body, Exists&& exists) {
  if (n_blocks == 0 || n_threads == 0) return;
  std::lock_guard<std::mutex> launch_guard(launch_mutex());
  Block b(n_threads);
  prepare_block(b, 0, exists);
  auto worker = [&](unsigned tid) {
    tls.block = &b;
    tls.tid = tid;
    for (uint64_t blk = 0; blk < n_blocks; ++blk) {
      const bool existed = exists(blk, tid);
      bool ok = true;
      if (existed) {
        try {
          body(blk, tid);
        } catch (const Abort&) {
          ok = false;
        } catch (const std::exception& e) {
          std::unique_lock<std::mutex> lock(b.m);
          try {
            fail_locked(b, std::string("kernel threw: ") + e.what() + " (" + thread_name(tid) + ")");
          } catch (const Abort&) {
          }
          ok = false;
        }
      }
      if (!ok) return;
      std::unique_lock<std::mutex> lock(b.m);
      if (b.aborted) return;
      try {
        exit_thread_locked(b, tid, existed);
      } catch (const Abort&) {
        return;
      }
      const uint64_t my_generation = b.block_generation;
      if (++b.finished == b.n_threads) {
        if (blk + 1 < n_blocks) prepare_block(b, blk + 1, exists);
        ++b.block_generation;
        b.cv.notify_all();
      } else {
        b.cv.wait(lock, [&] { return b.aborted || b.block_generation != my_generation; });
        if (b.aborted) return;
      }
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(n_threads);
  for (unsigned t = 0; t < n_threads; ++t) threads.emplace_back(worker, t);
  for (auto& t : threads) t.join();
  if (b.aborted) throw LaunchError("simt: " + b.error);
}

template <class T>
uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "warp collectives move up to 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}

template <class T>
T from_bits(uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

// Shuffle parameters: the source lane, or -1 when the lane keeps its own value.
inline uint64_t read_lane(const uint64_t* vals, const int64_t* params, uint32_t members, int lane) {
  const int64_t src = params[lane];
  if (src < 0) return vals[lane];
  if (src >= kWarp || !(members >> src & 1)) {
    Block& b = *tls.block;
    fail_locked(b, "shuffle: lane " + std::to_string(lane) + " reads lane " + std::to_string(src) +
                       ", which is not taking part");
  }
  return vals[src];
}

inline uint64_t ballot_fn(const uint64_t* vals, const int64_t*, uint32_t members, int) {
  uint64_t bits = 0;
  for (int l = 0; l < kWarp; ++l)
    if ((members >> l & 1) && vals[l]) bits |= uint64_t(1) << l;
  return bits;
}

inline uint64_t nothing_fn(const uint64_t*, const int64_t*, uint32_t, int) {
  return 0;
}

// The source lane of a CUDA shuffle within segments of `width` lanes, or -1 for "keep own value".
inline int64_t cuda_shfl_src(int lane, int target, int width) {
  const int seg = lane & ~(width - 1);
  if (target < seg || target >= seg + width) return -1;
  return target;
}

inline void check_width(int width) {
  if (width <= 0 || width > kWarp || (width & (width - 1)))
    throw std::invalid_argument("shuffle width must be a power of two in [1, 32], got " + std::to_string(width));
}

inline int lane_id() {
  return static_cast<int>(tls.tid % kWarp);
}

}  // namespace detail

// Runs `body()` on every thread of a grid (CUDA launch semantics, 3-D grid and block).
template <class Body>
void launch(dim3 grid, dim3 block, Body&& body) {
  const uint64_t n_blocks = uint64_t(grid.x) * grid.y * grid.z;
  const unsigned n_threads = block.x * block.y * block.z;
  if (n_threads > 1024) throw std::invalid_argument("simt::launch: more than 1024 threads per block");
  detail::run_blocks(
      n_blocks, n_threads,
      [&](uint64_t blk, unsigned tid) {
        blockIdx = {unsigned(blk % grid.x), unsigned(blk / grid.x % grid.y),
                    unsigned(blk / (uint64_t(grid.x) * grid.y))};
        threadIdx = {tid % block.x, tid / block.x % block.y, tid / (block.x * block.y)};
        blockDim = block;
        gridDim = grid;
        body();
      },
      [](uint64_t, unsigned) { return true; });
}

// The launch policy the shipped CUDA launchers (csrc/cuda/*_kernel.cuh) are instantiated with on the emulation;
// csrc/cuda/cuda_launch.cuh has the real one. A misbehaving kernel throws LaunchError from here, so the returned
// status is always cudaSuccess.
struct EmulatedLaunch {
  template <class... Params, class... Args>
  cudaError_t operator()(void (*kernel)(Params...), dim3 grid, dim3 block, const Args&... args) const {
    launch(grid, block, [&] { kernel(args...); });
    return cudaSuccess;
  }
  cudaError_t fill_bytes(void* dst, int value, std::size_t bytes) const {
    std::memset(dst, value, bytes);
    return cudaSuccess;
  }
};

}  // namespace simt

// ---- CUDA intrinsics -------------------------------------------------------------------------------------------

inline int __popc(unsigned x) {
  return __builtin_popcount(x);
}
inline int __popcll(unsigned long long x) {
  return __builtin_popcountll(x);
}

template <class T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
  using namespace simt::detail;
  check_width(width);
  const int lane = lane_id();
  const int64_t src = (lane & ~(width - 1)) + (src_lane & (width - 1));
  return from_bits<T>(collective("__shfl_sync", read_lane, true, mask, to_bits(var), src));
}

template <class T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  using namespace simt::detail;
  check_width(width);
  const int lane = lane_id();
  return from_bits<T>(
      collective("__shfl_up_sync", read_lane, true, mask, to_bits(var), cuda_shfl_src(lane, lane - int(delta), width)));
}

template <class T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  using namespace simt::detail;
  check_width(width);
  const int lane = lane_id();
  return from_bits<T>(collective("__shfl_down_sync", read_lane, true, mask, to_bits(var),
                                 cuda_shfl_src(lane, lane + int(delta), width)));
}

template <class T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
  using namespace simt::detail;
  check_width(width);
  const int lane = lane_id();
  // PTX bfly: a source in a later segment keeps the lane's own value.
  const int target = lane ^ lane_mask;
  const int64_t src = target >= ((lane & ~(width - 1)) + width) ? -1 : target;
  return from_bits<T>(collective("__shfl_xor_sync", read_lane, true, mask, to_bits(var), src));
}

inline unsigned __ballot_sync(unsigned mask, int predicate) {
  using namespace simt::detail;
  return unsigned(collective("__ballot_sync", ballot_fn, true, mask, predicate != 0, 0));
}

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  using namespace simt::detail;
  collective("__syncwarp", nothing_fn, true, mask, 0, 0);
}

inline void __syncthreads() {
  simt::detail::syncthreads();
}

// Atomics on memory shared by the emulated threads (GCC builtins: sequentially consistent, any address).
inline unsigned long long atomicMin(unsigned long long* addr, unsigned long long val) {
  unsigned long long old = __atomic_load_n(addr, __ATOMIC_SEQ_CST);
  while (val < old && !__atomic_compare_exchange_n(addr, &old, val, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}

template <class T>
T atomicAdd(T* addr, T val) {
  static_assert(std::is_integral<T>::value, "simt atomicAdd supports integers");
  return __atomic_fetch_add(addr, val, __ATOMIC_SEQ_CST);
}
