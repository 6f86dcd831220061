// Paged decode attention (paged_decode.cpp) in parts: the units of a step, each computed by one
// thread, then the chunked items merged. paged_decode runs them with at::parallel_for; the decode
// plan's team (csrc/team.h) splits them between its threads with a barrier in between.
#pragma once
#include <c10/core/ScalarType.h>
#include <cstdint>
#include <utility>
#include <vector>
#include "prefetch.h"

// One unit of work: a chunk of a (sequence, kv head) item's attended positions
struct Unit {
  int64_t b, kh;       // the item
  int64_t start, n;    // its attended positions [start, start + n)
  int64_t partial;     // index of its partial result, or -1: the item's only chunk, written to out
};

// A step's units for one layer shape, and the partial results of its chunked items
struct PagedDecodeWork {
  int64_t B = 0, KVH = 0, G = 0, D = 0;
  std::vector<Unit> units;
  // per item (b * KVH + kh): its first partial and chunk count; chunk c is partial first + c * KVH
  std::vector<int64_t> first_partial, num_chunks;
  int64_t partials = 0;
  std::vector<int64_t> positions_before;  // per unit: the attended positions of the units before it
  std::vector<float> part_max, part_sum, part_out;  // per partial: G maxes, G sums, G * D outputs
};

// One layer's operands: q row b's H = KVH * G heads at q + b * q_stride ([H, D] contiguous); the
// layer's pools [slots, KVH, D] of `dtype` (fp32, bf16 or fp16); block tables [B, table_width];
// out [B, H, D]
struct PagedDecodeArgs {
  const float* q;
  int64_t q_stride;
  const void* k;
  const void* v;
  c10::ScalarType dtype;
  const int64_t* tables;
  int64_t table_width, block_size;
  float scale;
  float* out;
};

// the units for context lengths `lens` [B] (the cut depends only on each length)
PagedDecodeWork paged_decode_work(const int64_t* lens, int64_t B, int64_t KVH, int64_t G, int64_t D,
                                  int64_t sliding_window);
// thread `share` of `shares`'s units [first, second): a run of about 1 / shares of the step's attended positions
std::pair<int64_t, int64_t> paged_decode_share(const PagedDecodeWork& work, int64_t share, int64_t shares);
// units [u0, u1): single-chunk items normalised into out, chunks into their partials
void paged_decode_units(PagedDecodeWork& work, const PagedDecodeArgs& args, int64_t u0, int64_t u1);
// items [i0, i1) (b * KVH + kh) with chunks: their partials merged into out, after every unit ran
void paged_decode_merge(PagedDecodeWork& work, float* out, int64_t i0, int64_t i1);

// The byte offsets in a layer's pool of the K (and V) rows that units [u0, u1) read, in the order they
// read them (`args`' block tables, block size and pool dtype; its q, out and pools are not used): the
// rows a RowStream (csrc/prefetch.h) prefetches for those units ahead of their attention.
std::vector<int64_t> paged_decode_rows(const PagedDecodeWork& work, const PagedDecodeArgs& args, int64_t u0,
                                       int64_t u1);
