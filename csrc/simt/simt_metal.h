// Metal side of the CPU SIMT emulation (see simt.h): threadgroups are blocks, simdgroups are warps of 32.
//
// A Metal kernel body written for mlx.core.fast.metal_kernel is #included into a C++ function whose parameters
// carry the names MLX generates (inputs, outputs, the [[thread_position_in_grid]]-style attributes it uses), between
// "simt/metal_begin.h" and "simt/metal_end.h", which turn the address-space qualifiers into C++ (`threadgroup`
// declarations become block-shared statics, as __shared__ does). The function is run with simt::dispatch_threads.
//
// SIMD-group functions take every running lane of the simdgroup (Metal's active lanes when no lane diverges).
// Lanes of one simdgroup calling different SIMD functions at the same time (divergent branches each doing their
// own reduction) are reported as an error rather than emulated.
#pragma once

#include <cmath>
#include <type_traits>

#include "simt/simt.h"

namespace metal {

using uchar = unsigned char;
using ushort = unsigned short;

enum class mem_flags : unsigned { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) {
  return mem_flags(unsigned(a) | unsigned(b));
}

inline void threadgroup_barrier(mem_flags) {
  simt::detail::syncthreads();
}

template <class To, class From>
To as_type(From v) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs types of one size");
  To out;
  std::memcpy(&out, &v, sizeof(To));
  return out;
}

template <class T>
T popcount(T x) {
  static_assert(std::is_integral<T>::value, "popcount takes an integer");
  return T(__builtin_popcountll(static_cast<unsigned long long>(static_cast<std::make_unsigned_t<T>>(x))));
}

namespace detail {
using simt::detail::from_bits;
using simt::detail::kWarp;
using simt::detail::to_bits;

// a + b as a GPU adds: integers wrap. Signed overflow is undefined in C++, so integers add in their unsigned type
// (the conversion back wraps, C++20).
template <class T>
T wrapping_add(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return T(U(a) + U(b));
  } else {
    return T(a + b);
  }
}

// Sum over the members, or over the members below `lane` (exclusive) / up to it (inclusive).
enum class Span { all, below, upto };
template <class T, Span span>
uint64_t sum_fn(const uint64_t* vals, const int64_t*, uint32_t members, int lane) {
  T acc = T(0);
  for (int l = 0; l < kWarp; ++l) {
    const bool in = span == Span::all || (span == Span::below ? l < lane : l <= lane);
    if (in && (members >> l & 1)) acc = wrapping_add(acc, from_bits<T>(vals[l]));
  }
  return to_bits(acc);
}

// The largest of the members' values (floats: NaN only when every member's is NaN, as fmax).
template <class T>
uint64_t max_fn(const uint64_t* vals, const int64_t*, uint32_t members, int) {
  bool first = true;
  T acc = T(0);
  for (int l = 0; l < kWarp; ++l) {
    if (!(members >> l & 1)) continue;
    const T v = from_bits<T>(vals[l]);
    if constexpr (std::is_floating_point_v<T>) {
      acc = first ? v : std::fmax(acc, v);
    } else {
      acc = first || v > acc ? v : acc;
    }
    first = false;
  }
  return to_bits(acc);
}
template <class T>
T simd_collective(const char* name, simt::detail::CollectiveFn fn, T v, int64_t param) {
  return from_bits<T>(simt::detail::collective(name, fn, false, 0, to_bits(v), param));
}

inline int lane() {
  return simt::detail::lane_id();
}
}  // namespace detail

template <class T>
T simd_sum(T v) {
  return detail::simd_collective("simd_sum", detail::sum_fn<T, detail::Span::all>, v, 0);
}
template <class T>
T simd_max(T v) {
  return detail::simd_collective("simd_max", detail::max_fn<T>, v, 0);
}
template <class T>
T simd_prefix_exclusive_sum(T v) {
  return detail::simd_collective("simd_prefix_exclusive_sum", detail::sum_fn<T, detail::Span::below>, v, 0);
}
template <class T>
T simd_prefix_inclusive_sum(T v) {
  return detail::simd_collective("simd_prefix_inclusive_sum", detail::sum_fn<T, detail::Span::upto>, v, 0);
}

template <class T>
T simd_shuffle(T v, ushort src_lane) {
  return detail::simd_collective("simd_shuffle", simt::detail::read_lane, v, src_lane);
}
// Lanes whose source falls outside the simdgroup keep their own value.
template <class T>
T simd_shuffle_up(T v, ushort delta) {
  const int src = detail::lane() - int(delta);
  return detail::simd_collective("simd_shuffle_up", simt::detail::read_lane, v, src < 0 ? -1 : src);
}
template <class T>
T simd_shuffle_down(T v, ushort delta) {
  const int src = detail::lane() + int(delta);
  return detail::simd_collective("simd_shuffle_down", simt::detail::read_lane, v, src >= detail::kWarp ? -1 : src);
}
template <class T>
T simd_shuffle_xor(T v, ushort mask) {
  const int src = detail::lane() ^ int(mask);
  return detail::simd_collective("simd_shuffle_xor", simt::detail::read_lane, v, src >= detail::kWarp ? -1 : src);
}

struct simd_vote {
  using vote_t = uint64_t;
  vote_t bits;
  explicit operator vote_t() const { return bits; }
  bool any() const { return bits != 0; }
};
inline simd_vote simd_ballot(bool predicate) {
  return {simt::detail::collective("simd_ballot", simt::detail::ballot_fn, false, 0, predicate, 0)};
}

}  // namespace metal

namespace simt {

// The values of Metal's thread attributes for one thread (the names MLX's signature uses).
struct MetalThread {
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid;
  uint3 threads_per_threadgroup, threadgroups_per_grid, threads_per_grid;
  unsigned thread_index_in_threadgroup, thread_index_in_simdgroup, simdgroup_index_in_threadgroup;
  unsigned threads_per_simdgroup, simdgroups_per_threadgroup;
};

// dispatchThreads semantics, as MLX uses: `grid` counts threads, threadgroups at the far edges are cut short.
// Runs body(const MetalThread&) on every thread.
template <class Body>
void dispatch_threads(uint3 grid, uint3 threadgroup, Body&& body) {
  if (threadgroup.x == 0 || threadgroup.y == 0 || threadgroup.z == 0)
    throw std::invalid_argument("simt::dispatch_threads: empty threadgroup");
  const unsigned n_threads = threadgroup.x * threadgroup.y * threadgroup.z;
  if (n_threads > 1024) throw std::invalid_argument("simt::dispatch_threads: more than 1024 threads per threadgroup");
  const uint3 groups{(grid.x + threadgroup.x - 1) / threadgroup.x, (grid.y + threadgroup.y - 1) / threadgroup.y,
                     (grid.z + threadgroup.z - 1) / threadgroup.z};
  auto attributes = [=](uint64_t blk, unsigned tid) {
    MetalThread t;
    t.threadgroup_position_in_grid = {unsigned(blk % groups.x), unsigned(blk / groups.x % groups.y),
                                      unsigned(blk / (uint64_t(groups.x) * groups.y))};
    t.thread_position_in_threadgroup = {tid % threadgroup.x, tid / threadgroup.x % threadgroup.y,
                                        tid / (threadgroup.x * threadgroup.y)};
    t.thread_position_in_grid = {t.threadgroup_position_in_grid.x * threadgroup.x + t.thread_position_in_threadgroup.x,
                                 t.threadgroup_position_in_grid.y * threadgroup.y + t.thread_position_in_threadgroup.y,
                                 t.threadgroup_position_in_grid.z * threadgroup.z + t.thread_position_in_threadgroup.z};
    t.threads_per_threadgroup = threadgroup;
    t.threadgroups_per_grid = groups;
    t.threads_per_grid = grid;
    t.thread_index_in_threadgroup = tid;
    t.thread_index_in_simdgroup = tid % detail::kWarp;
    t.simdgroup_index_in_threadgroup = tid / detail::kWarp;
    t.threads_per_simdgroup = detail::kWarp;
    t.simdgroups_per_threadgroup = (n_threads + detail::kWarp - 1) / detail::kWarp;
    return t;
  };
  detail::run_blocks(
      uint64_t(groups.x) * groups.y * groups.z, n_threads,
      [&](uint64_t blk, unsigned tid) {
        const MetalThread t = attributes(blk, tid);
        blockIdx = t.threadgroup_position_in_grid;  // names the threadgroup in error messages
        body(t);
      },
      [&](uint64_t blk, unsigned tid) {
        const uint3 p = attributes(blk, tid).thread_position_in_grid;
        return p.x < grid.x && p.y < grid.y && p.z < grid.z;
      });
}

}  // namespace simt
