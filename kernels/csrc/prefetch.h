// Software prefetch into L2 for the CPU kernels that stream weights (decode reads each weight once).
#pragma once
#include <cstdint>

namespace llmopt_prefetch {

inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }  // locality 2: prefetcht1 on x86

// every cache line of [p, p + bytes)
inline void prefetch_span(const void* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) prefetch_l2(static_cast<const char*>(p) + i);
}

}  // namespace llmopt_prefetch

// A weight tensor's bytes, to prefetch a thread's share of (int4_linear_next): at most max_bytes of it.
struct WeightRegion {
  const char* data;
  int64_t bytes, max_bytes;
};
