// The threads of one OpenMP parallel region working through a sequence of phases (the decode plan's
// layers), meeting at a spin barrier between phases.
//
// at::parallel_for opens and closes a parallel region per call: ~1.5 us on 2 threads of a Zen 4 VM,
// five times a layer in a decode step. A spin barrier between phases of one region costs ~0.16 us.
// Each thread takes its share of a phase's units with `split` (at::parallel_for's split), so a
// kernel's per-element arithmetic does not change with the threads that run it.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <sched.h>

namespace llmopt_team {

struct Range {
  int64_t begin, end;
};

// Share `share` of `shares` of [0, n): as at::parallel_for(0, n, grain, ...) cuts it (at most
// ceil(n / grain) non-empty shares of ceil(n / used) units each); the others empty.
inline Range split(int64_t n, int64_t grain, int64_t share, int64_t shares) {
  if (n <= 0) return {0, 0};
  const int64_t used = std::max<int64_t>(1, std::min(shares, (n + grain - 1) / std::max<int64_t>(grain, 1)));
  const int64_t chunk = (n + used - 1) / used;
  const int64_t begin = std::min(n, share * chunk);
  return {begin, std::min(n, begin + chunk)};
}

// A barrier for the `size` threads of a team. The count only grows: the k-th barrier is passed when
// it reaches k * size, so no thread can run into the next barrier's wait before every other left this one.
class Barrier {
 public:
  // every thread of the region sets the size (all the same value) before its first wait
  void set_size(int64_t size) { size_.store(size, std::memory_order_relaxed); }

  // `passed`: the calling thread's count of barriers passed so far
  void wait(int64_t& passed) {
    ++passed;
    const int64_t target = passed * size_.load(std::memory_order_relaxed);
    arrived_.fetch_add(1, std::memory_order_acq_rel);
    // spin (a phase's imbalance is microseconds); yield after ~1 ms so an oversubscribed machine
    // still moves
    for (int64_t spins = 0; arrived_.load(std::memory_order_acquire) < target; ++spins) {
      if (spins < kSpinsBeforeYield) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      } else {
        sched_yield();
      }
    }
  }

 private:
  static constexpr int64_t kSpinsBeforeYield = 1 << 15;
  alignas(64) std::atomic<int64_t> arrived_{0};
  alignas(64) std::atomic<int64_t> size_{1};
};

// One thread's view of the team: its rank, the team's size, and the barrier
struct Team {
  int64_t rank, size;
  Barrier& barrier;
  int64_t passed = 0;

  void sync() { barrier.wait(passed); }
  Range share(int64_t n, int64_t grain = 1) const { return split(n, grain, rank, size); }
};

}  // namespace llmopt_team
