// Software prefetch into L2 for the CPU kernels that stream weights (decode reads each weight once).
#pragma once
#include <cstdint>

namespace llmopt_prefetch {

inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }  // locality 2: prefetcht1 on x86

// every cache line of [p, p + bytes)
inline void prefetch_span(const void* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) prefetch_l2(static_cast<const char*>(p) + i);
}

// Rows of two regions at the same byte offsets (a layer's K and V pools) that a later phase reads,
// prefetched into L2 a little at a time by a kernel bound by its arithmetic: `issue` between pieces
// of its own work, so the rows come from memory while the core computes.
struct RowStream {
  const char* first = nullptr;
  const char* second = nullptr;
  const int64_t* offsets = nullptr;  // [end] the rows' byte offsets, in the order they are read
  int64_t row_bytes = 0;
  int64_t next = 0, end = 0, within = 0;  // the next row, its bytes already asked for

  // the next `bytes` of each region's rows
  inline void issue(int64_t bytes) {
    for (int64_t budget = bytes; budget > 0 && next < end;) {
      const int64_t take = row_bytes - within < budget ? row_bytes - within : budget;
      prefetch_span(first + offsets[next] + within, take);
      prefetch_span(second + offsets[next] + within, take);
      budget -= take;
      within += take;
      if (within == row_bytes) {
        within = 0;
        ++next;
      }
    }
  }
};

}  // namespace llmopt_prefetch

// A weight tensor's bytes, to prefetch a thread's share of (int4_linear_next): at most max_bytes of it.
struct WeightRegion {
  const char* data;
  int64_t bytes, max_bytes;
};
