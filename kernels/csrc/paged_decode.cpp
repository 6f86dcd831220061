// Paged decode attention on CPU: one fp32 query token per sequence against its K/V, read
// straight from the block pool through the block table (no gather), each key and value row
// once for all the query heads that share it (grouped-query attention). Two-pass softmax per
// (sequence, kv head, chunk of 128 positions), chunks merged by their maxes. The pool may hold fp32, bf16 or fp16 K/V (`--kv-cache-dtype`): 16-bit
// rows are widened to fp32 as they are loaded, so scores, softmax, accumulation and output stay
// fp32 and a 16-bit pool halves the bytes read. With AVX2 + FMA and head_dim % 8 == 0: 8 keys
// per group of FMA chains, vectorised exp, prefetch of the next scattered rows; on the AVX-512 path
// (csrc/isa.h) and head_dim % 16 == 0 the same sums with each row loaded once for up to 3 (scores)
// or 4 (values) query heads, bitwise the AVX2 path's; otherwise plain loops. The pure-PyTorch path
// (kernels/paged_attention.py) is the reference.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
#include "isa.h"
#include "paged_decode.h"

// Each (sequence, kv head) item: `rows[i]` is the element offset of the i-th attended position's
// key (and value) row for that head in the pool; G query heads share those rows.
struct Item {
  const float* q;          // [G, D] the query heads of this kv head
  const int64_t* rows;     // [n]
  int64_t n, G, D;
  float scale;
};

// T: the pool's element type (float, c10::BFloat16 or c10::Half); static_cast<float> widens
// exactly (bf16: the 16 bits shifted into the top of an fp32; fp16: every value representable)

// 8 independent partial sums: the compiler vectorises this without reassociating floats
template <typename T>
static inline float dot(const float* a, const T* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * static_cast<float>(b[i + j]);
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * static_cast<float>(b[i]);
  return s;
}

// scores[g * n + i] = q_g . k_i * scale, and maxes[g] = max_i of them
template <typename T>
static void scores_generic(const Item& it, const T* k, float* scores, float* maxes) {
  for (int64_t i = 0; i < it.n; ++i)
    for (int64_t g = 0; g < it.G; ++g) {
      const float s = dot(it.q + g * it.D, k + it.rows[i], it.D) * it.scale;
      scores[g * it.n + i] = s;
      maxes[g] = std::max(maxes[g], s);
    }
}

// out_g = sum_i p[g * n + i] * v_i / sums[g]
template <typename T>
static void values_generic(const Item& it, const T* v, const float* p, const float* sums, float* out) {
  for (int64_t g = 0; g < it.G; ++g) {
    float* o = out + g * it.D;
    std::fill(o, o + it.D, 0.f);
    for (int64_t i = 0; i < it.n; ++i) {
      const float w = p[g * it.n + i];
      const T* vr = v + it.rows[i];
      for (int64_t d = 0; d < it.D; ++d) o[d] += w * static_cast<float>(vr[d]);
    }
    const float inv = 1.f / sums[g];
    for (int64_t d = 0; d < it.D; ++d) o[d] *= inv;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
#include "vec_math.h"

// s[i] = exp(s[i] - m) in place; returns their sum
static inline float exp_shifted(float* s, int64_t n, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, acc);
  float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  if (i < n) {  // the tail through the same code, padded to 8 lanes (the padding is dropped)
    float tail[8];
    for (int j = 0; j < 8; ++j) tail[j] = i + j < n ? s[i + j] : m;
    _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), vm)));
    for (int64_t j = 0; i + j < n; ++j) {
      s[i + j] = tail[j];
      sum += tail[j];
    }
  }
  return sum;
}

// 8 pool elements as 8 fp32 lanes: fp32 and bf16 through vec_math.h's load8, fp16 here
#if defined(__F16C__)
static inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#else
static inline __m256 load8(const c10::Half* p) {
  float f[8];
  for (int j = 0; j < 8; ++j) f[j] = static_cast<float>(p[j]);
  return _mm256_loadu_ps(f);
}
#endif

// one prefetch per 64-byte cache line of the row's n elements, into L2 (T1): each row is read once,
// a few positions later, and the reads are bound by how many lines are in flight, not by L1 hits
// (on a Zen 4 the T1 hint read the pool ~15% faster than T0)
template <typename T>
static inline void prefetch_row(const T* row, int64_t n) {
  constexpr int64_t step = 64 / sizeof(T);
  for (int64_t d = 0; d < n; d += step) _mm_prefetch(reinterpret_cast<const char*>(row + d), _MM_HINT_T1);
}

// the 8 lane-sums of a[0..7], as one vector
static inline __m256 reduce8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// positions [i0, n) (fewer than 8, after the 8-key groups) against heads [g0, g1), one key at a time
// with the 8-key path's reduction
template <typename T>
static void score_tail(const Item& it, const T* k, int64_t i0, int64_t g0, int64_t g1, float* scores, float* maxes) {
  const int64_t n = it.n, D = it.D;
  for (int64_t i = i0; i < n; ++i)
    for (int64_t g = g0; g < g1; ++g) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(it.q + g * D + d), load8(k + it.rows[i] + d), acc);
      __m256 one[8] = {acc, acc, acc, acc, acc, acc, acc, acc};  // same reduction as the 8-key path
      float lanes[8];
      _mm256_storeu_ps(lanes, reduce8(one));
      const float s = lanes[0] * it.scale;
      scores[g * n + i] = s;
      maxes[g] = std::max(maxes[g], s);
    }
}

// positions ahead to prefetch in the score pass (16 and 32 measured alike, 8 slower: docs/benchmarks.md,
// "Paged decode attention")
static constexpr int64_t kAhead = 16;

// D % 8 == 0: 8 keys at a time, 8 independent FMA chains, one vector of 8 scores per head
template <typename T>
static void scores_avx2(const Item& it, const T* k, const T* v, float* scores, float* maxes) {
  const int64_t n = it.n, D = it.D;
  const __m256 vscale = _mm256_set1_ps(it.scale);
  // keys and values kAhead positions ahead (the rows are scattered, so no hardware prefetcher follows
  // them): the values too, so the value pass finds its rows in L2; the first kAhead up front
  for (int64_t j = 0; j < std::min(n, kAhead); ++j) {
    prefetch_row(k + it.rows[j], D);
    prefetch_row(v + it.rows[j], D);
  }
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const T* kr[8];
    for (int r = 0; r < 8; ++r) kr[r] = k + it.rows[i + r];
    for (int64_t j = i + kAhead; j < std::min(n, i + kAhead + 8); ++j) {
      prefetch_row(k + it.rows[j], D);
      prefetch_row(v + it.rows[j], D);
    }
    for (int64_t g = 0; g < it.G; ++g) {
      const float* qg = it.q + g * D;
      __m256 acc[8];
      for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + d);
        for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(qv, load8(kr[r] + d), acc[r]);
      }
      const __m256 s = _mm256_mul_ps(reduce8(acc), vscale);
      _mm256_storeu_ps(scores + g * n + i, s);
      float lanes[8];
      _mm256_storeu_ps(lanes, s);
      for (int r = 0; r < 8; ++r) maxes[g] = std::max(maxes[g], lanes[r]);
    }
  }
  score_tail(it, k, i, 0, it.G, scores, maxes);
}

// out[0 .. 8 * C) of one head = sum_i p[i] * v_i[d0 ..] / sum: C accumulators across all rows. C is
// a compile-time count so the accumulators stay in registers (with a run-time count the compiler
// kept them on the stack, a store and a reload per FMA).
template <int C, typename T>
static inline void values_block(const Item& it, const T* v, const float* p, float inv_sum, int64_t d0, float* out) {
  __m256 acc[C];
  for (int j = 0; j < C; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < it.n; ++i) {
    if (i + 4 < it.n) prefetch_row(v + it.rows[i + 4] + d0, 8 * C);
    const __m256 w = _mm256_set1_ps(p[i]);
    const T* vr = v + it.rows[i] + d0;
    for (int j = 0; j < C; ++j) acc[j] = _mm256_fmadd_ps(w, load8(vr + 8 * j), acc[j]);
  }
  const __m256 inv = _mm256_set1_ps(inv_sum);
  for (int j = 0; j < C; ++j) _mm256_storeu_ps(out + d0 + 8 * j, _mm256_mul_ps(acc[j], inv));
}

// D % 8 == 0: per head, 64 output floats at a time (then the 8-float remainder blocks)
template <typename T>
static void values_avx2(const Item& it, const T* v, const float* p, const float* sums, float* out) {
  const int64_t n = it.n, D = it.D;
  for (int64_t g = 0; g < it.G; ++g) {
    const float* pg = p + g * n;
    float* og = out + g * D;
    const float inv = 1.f / sums[g];
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) values_block<8>(it, v, pg, inv, d0, og);
    switch ((D - d0) / 8) {
      case 7: values_block<7>(it, v, pg, inv, d0, og); break;
      case 6: values_block<6>(it, v, pg, inv, d0, og); break;
      case 5: values_block<5>(it, v, pg, inv, d0, og); break;
      case 4: values_block<4>(it, v, pg, inv, d0, og); break;
      case 3: values_block<3>(it, v, pg, inv, d0, og); break;
      case 2: values_block<2>(it, v, pg, inv, d0, og); break;
      case 1: values_block<1>(it, v, pg, inv, d0, og); break;
      default: break;
    }
  }
}

static constexpr bool kHaveAvx2 = true;

#if LLMOPT_COMPILED_AVX512
// The AVX-512 path: the same sums as scores_avx2 / values_block, each key and value row loaded (and
// widened, for a 16-bit pool) once for a group of query heads instead of once per head. The 8-lane
// path reloads a row per head because 8 keys' chains for one head fill AVX2's 16 registers; AVX-512's
// 32 hold them for three heads. Every (key, head) dot product and every output lane takes the same
// FMAs in the same order as on the 8-lane path, so the two paths' results are bitwise equal.

// 16 pool elements as 16 fp32 lanes
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
static inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// heads [g0, g0 + GB) of scores_avx2, 8 keys at a time: 8 * GB chains of 8 lanes (the d-th piece of
// key r feeds the GB heads' chains of r); `prefetch`: the group that walks ahead for every group
template <int GB, typename T>
static void scores_group(const Item& it, int64_t g0, const T* k, const T* v, bool prefetch, float* scores,
                         float* maxes) {
  const int64_t n = it.n, D = it.D;
  const __m256 vscale = _mm256_set1_ps(it.scale);
  if (prefetch)
    for (int64_t j = 0; j < std::min(n, kAhead); ++j) {
      prefetch_row(k + it.rows[j], D);
      prefetch_row(v + it.rows[j], D);
    }
  __m256 vmax[GB];
  for (int g = 0; g < GB; ++g) vmax[g] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const T* kr[8];
    for (int r = 0; r < 8; ++r) kr[r] = k + it.rows[i + r];
    if (prefetch)
      for (int64_t j = i + kAhead; j < std::min(n, i + kAhead + 8); ++j) {
        prefetch_row(k + it.rows[j], D);
        prefetch_row(v + it.rows[j], D);
      }
    __m256 acc[GB][8];
    for (int g = 0; g < GB; ++g)
      for (int r = 0; r < 8; ++r) acc[g][r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      __m256 qv[GB];
      for (int g = 0; g < GB; ++g) qv[g] = _mm256_loadu_ps(it.q + (g0 + g) * D + d);
      for (int r = 0; r < 8; ++r) {
        const __m256 kv = load8(kr[r] + d);
        for (int g = 0; g < GB; ++g) acc[g][r] = _mm256_fmadd_ps(qv[g], kv, acc[g][r]);
      }
    }
    for (int g = 0; g < GB; ++g) {
      const __m256 s = _mm256_mul_ps(reduce8(acc[g]), vscale);
      _mm256_storeu_ps(scores + (g0 + g) * n + i, s);
      vmax[g] = _mm256_max_ps(vmax[g], s);
    }
  }
  for (int g = 0; g < GB; ++g) {
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax[g]);
    for (float s : lanes) maxes[g0 + g] = std::max(maxes[g0 + g], s);
  }
  score_tail(it, k, i, g0, g0 + GB, scores, maxes);
}

template <typename T>
static void scores_avx512(const Item& it, const T* k, const T* v, float* scores, float* maxes) {
  for (int64_t g0 = 0; g0 < it.G; g0 += 3) {
    const bool first = g0 == 0;
    switch (std::min<int64_t>(3, it.G - g0)) {
      case 3: scores_group<3>(it, g0, k, v, first, scores, maxes); break;
      case 2: scores_group<2>(it, g0, k, v, first, scores, maxes); break;
      default: scores_group<1>(it, g0, k, v, first, scores, maxes); break;
    }
  }
}

// heads [g0, g0 + GB), output floats [d0, d0 + 16 * C): each value row's piece loaded once for the GB
// heads; lane d of a head's accumulator sums p[i] * v_i[d] over i in order, as values_block's
template <int GB, int C, typename T>
static void values_group(const Item& it, int64_t g0, const T* v, const float* p, const float* sums, int64_t d0,
                         float* out) {
  const int64_t n = it.n;
  __m512 acc[GB][C];
  for (int g = 0; g < GB; ++g)
    for (int j = 0; j < C; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    if (i + 4 < n) prefetch_row(v + it.rows[i + 4] + d0, 16 * C);
    const T* vr = v + it.rows[i] + d0;
    __m512 w[GB];
    for (int g = 0; g < GB; ++g) w[g] = _mm512_set1_ps(p[(g0 + g) * n + i]);
    for (int j = 0; j < C; ++j) {
      const __m512 vv = load16(vr + 16 * j);
      for (int g = 0; g < GB; ++g) acc[g][j] = _mm512_fmadd_ps(w[g], vv, acc[g][j]);
    }
  }
  for (int g = 0; g < GB; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / sums[g0 + g]);
    for (int j = 0; j < C; ++j) _mm512_storeu_ps(out + (g0 + g) * it.D + d0 + 16 * j, _mm512_mul_ps(acc[g][j], inv));
  }
}

template <int GB, typename T>
static void values_heads(const Item& it, int64_t g0, const T* v, const float* p, const float* sums, float* out) {
  for (int64_t d0 = 0; d0 < it.D; d0 += 64) {
    switch (std::min<int64_t>(4, (it.D - d0) / 16)) {
      case 4: values_group<GB, 4>(it, g0, v, p, sums, d0, out); break;
      case 3: values_group<GB, 3>(it, g0, v, p, sums, d0, out); break;
      case 2: values_group<GB, 2>(it, g0, v, p, sums, d0, out); break;
      default: values_group<GB, 1>(it, g0, v, p, sums, d0, out); break;
    }
  }
}

// D % 16 == 0: up to 4 heads at a time, 64 output floats at a time
template <typename T>
static void values_avx512(const Item& it, const T* v, const float* p, const float* sums, float* out) {
  for (int64_t g0 = 0; g0 < it.G; g0 += 4) {
    switch (std::min<int64_t>(4, it.G - g0)) {
      case 4: values_heads<4>(it, g0, v, p, sums, out); break;
      case 3: values_heads<3>(it, g0, v, p, sums, out); break;
      case 2: values_heads<2>(it, g0, v, p, sums, out); break;
      default: values_heads<1>(it, g0, v, p, sums, out); break;
    }
  }
}
#endif  // LLMOPT_COMPILED_AVX512

#else


static inline float exp_shifted(float* s, int64_t n, float m) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  return sum;
}


template <typename T>
static void scores_avx2(const Item&, const T*, const T*, float*, float*) {}
template <typename T>
static void values_avx2(const Item&, const T*, const float*, const float*, float*) {}
static constexpr bool kHaveAvx2 = false;

#endif

// A (sequence, kv head) item's attended positions are cut into chunks of kChunk positions, each chunk
// one unit of work, so a single sequence's few kv heads still keep every thread busy (batch 1: 3 kv
// heads on 2 threads left one idle a third of the time). A chunk keeps its own max, sum and
// unnormalised output, and the chunks of an item are merged in order (flash-decoding's split-K).
// The cut depends only on the context length, never on the batch or the thread count, so a
// sequence's output does not depend on either; an item of one chunk is normalised in place, as
// without chunks.
static constexpr int64_t kChunk = 128;

PagedDecodeWork paged_decode_work(const int64_t* lens, int64_t B, int64_t KVH, int64_t G, int64_t D,
                                  int64_t sliding_window) {
  PagedDecodeWork w;
  w.B = B;
  w.KVH = KVH;
  w.G = G;
  w.D = D;
  w.first_partial.assign(B * KVH, -1);
  w.num_chunks.assign(B * KVH, 1);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lens[b];
    const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
    const int64_t n = len - start, chunks = std::max<int64_t>(1, (n + kChunk - 1) / kChunk);
    if (chunks == 1) {
      for (int64_t kh = 0; kh < KVH; ++kh) w.units.push_back({b, kh, start, n, -1});
      continue;
    }
    // a chunk's kv heads one after another: they read the same token rows ([kv heads, head dim] each),
    // so the rows come from memory once, in order, and the next heads find them in cache
    for (int64_t kh = 0; kh < KVH; ++kh) {
      w.first_partial[b * KVH + kh] = w.partials + kh;
      w.num_chunks[b * KVH + kh] = chunks;
    }
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t kh = 0; kh < KVH; ++kh)
        w.units.push_back({b, kh, start + c * kChunk, std::min(kChunk, n - c * kChunk), w.partials + c * KVH + kh});
    w.partials += chunks * KVH;
  }
  w.positions_before.resize(w.units.size());
  int64_t positions = 0;
  for (size_t u = 0; u < w.units.size(); ++u) {
    w.positions_before[u] = positions;
    positions += w.units[u].n;
  }
  // per partial: G maxes, G sums, G * D unnormalised outputs
  w.part_max.resize(w.partials * G);
  w.part_sum.resize(w.partials * G);
  w.part_out.resize(w.partials * G * D);
  return w;
}

// A unit's time is about its positions' count, so the threads' runs of units are cut by positions, not
// by units: at batch 1 the 15 units of 576 positions (five chunks of each of 3 kv heads, the last 64
// long) cut 8 / 7 gave one thread 960 positions and the other 768; cut here, 832 / 896. The boundary
// of share s is the first unit whose midpoint reaches s / shares of all positions.
std::pair<int64_t, int64_t> paged_decode_share(const PagedDecodeWork& w, int64_t share, int64_t shares) {
  const int64_t units = static_cast<int64_t>(w.units.size());
  if (units == 0) return {0, 0};
  const int64_t total = w.positions_before.back() + w.units.back().n;
  const auto boundary = [&](int64_t s) {
    if (s <= 0) return int64_t{0};
    if (s >= shares) return units;
    int64_t u = 0;  // 2 * (before + n / 2) * shares >= 2 * total * s, in integers
    while (u < units && (2 * w.positions_before[u] + w.units[u].n) * shares < 2 * total * s) ++u;
    return u;
  };
  return {boundary(share), boundary(share + 1)};
}

// The element offset in a layer's pool of each attended position's row of `unit`'s kv head, into
// rows[0, unit.n): the block table walked once, a block at a time
static void unit_rows(const Unit& unit, const PagedDecodeArgs& a, int64_t KVH, int64_t D, int64_t* rows) {
  const int64_t* table = a.tables + unit.b * a.table_width;
  const int64_t stop_at = unit.start + unit.n;
  for (int64_t t = unit.start; t < stop_at;) {
    const int64_t block = t / a.block_size, stop = std::min(stop_at, (block + 1) * a.block_size);
    int64_t row = ((table[block] * a.block_size + t - block * a.block_size) * KVH + unit.kh) * D;
    for (; t < stop; ++t, row += KVH * D) rows[t - unit.start] = row;
  }
}

std::vector<int64_t> paged_decode_rows(const PagedDecodeWork& work, const PagedDecodeArgs& args, int64_t u0,
                                       int64_t u1) {
  const int64_t first = u1 > u0 ? work.positions_before[u0] : 0;
  std::vector<int64_t> rows(u1 > u0 ? work.positions_before[u1 - 1] + work.units[u1 - 1].n - first : 0);
  for (int64_t u = u0; u < u1; ++u)
    unit_rows(work.units[u], args, work.KVH, work.D, rows.data() + work.positions_before[u] - first);
  const int64_t element = static_cast<int64_t>(c10::elementSize(args.dtype));
  for (int64_t& row : rows) row *= element;  // bytes
  return rows;
}

// units [u0, u1) with pool element type T
template <typename T>
static void attend(PagedDecodeWork& w, const PagedDecodeArgs& a, int64_t u0, int64_t u1) {
  const int64_t G = w.G, D = w.D, KVH = w.KVH, H = KVH * G;
  const T* kp = static_cast<const T*>(a.k);
  const T* vp = static_cast<const T*>(a.v);
  const bool vectorised = kHaveAvx2 && D % 8 == 0;
  // the AVX-512 path's calls are compiled only where it is (csrc/isa.h; it implies the AVX2 block above)
  [[maybe_unused]] const bool wide =
      LLMOPT_COMPILED_AVX512 && D % 16 == 0 && llmopt_isa::active_isa() >= llmopt_isa::kAvx512;
  std::vector<float> scores, maxes(G), sums(G), ones(G, 1.f);
  std::vector<int64_t> rows;
  for (int64_t u = u0; u < u1; ++u) {
    const Unit& unit = w.units[u];
    const int64_t b = unit.b, kh = unit.kh, n = unit.n;
    rows.resize(n);
    unit_rows(unit, a, KVH, D, rows.data());
    const Item it{a.q + b * a.q_stride + kh * G * D, rows.data(), n, G, D, a.scale};
    scores.resize(G * n);  // [G][n]: each head's scores contiguous for the softmax
    std::fill(maxes.begin(), maxes.end(), -std::numeric_limits<float>::infinity());
#if LLMOPT_COMPILED_AVX512
    if (wide)
      scores_avx512(it, kp, vp, scores.data(), maxes.data());
    else
#endif
    if (vectorised)
      scores_avx2(it, kp, vp, scores.data(), maxes.data());
    else
      scores_generic(it, kp, scores.data(), maxes.data());
    for (int64_t g = 0; g < G; ++g) sums[g] = exp_shifted(scores.data() + g * n, n, maxes[g]);
    // the only chunk: normalised into out; else unnormalised into its partial
    const bool whole = unit.partial < 0;
    float* o = whole ? a.out + (b * H + kh * G) * D : w.part_out.data() + unit.partial * G * D;
    const float* divisors = whole ? sums.data() : ones.data();
#if LLMOPT_COMPILED_AVX512
    if (wide)
      values_avx512(it, vp, scores.data(), divisors, o);
    else
#endif
    if (vectorised)
      values_avx2(it, vp, scores.data(), divisors, o);
    else
      values_generic(it, vp, scores.data(), divisors, o);
    if (!whole)
      for (int64_t g = 0; g < G; ++g) {
        w.part_max[unit.partial * G + g] = maxes[g];
        w.part_sum[unit.partial * G + g] = sums[g];
      }
  }
}

void paged_decode_units(PagedDecodeWork& w, const PagedDecodeArgs& a, int64_t u0, int64_t u1) {
  switch (a.dtype) {
    case torch::kFloat32: return attend<float>(w, a, u0, u1);
    case torch::kBFloat16: return attend<c10::BFloat16>(w, a, u0, u1);
    default: return attend<c10::Half>(w, a, u0, u1);
  }
}

// merge each chunked item's partials: out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) s_c
void paged_decode_merge(PagedDecodeWork& w, float* out, int64_t i0, int64_t i1) {
  const int64_t G = w.G, D = w.D;
  for (int64_t item = i0; item < i1; ++item) {
    const int64_t p0 = w.first_partial[item];
    if (p0 < 0) continue;
    const int64_t chunks = w.num_chunks[item];
    for (int64_t g = 0; g < G; ++g) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < chunks; ++c) m = std::max(m, w.part_max[(p0 + c * w.KVH) * G + g]);
      float* o = out + (item * G + g) * D;  // item = b * KVH + kh, so (b * H + kh * G + g) * D
      std::fill(o, o + D, 0.f);
      float total = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t p = p0 + c * w.KVH;  // the item's chunk c (paged_decode_work: a chunk's kv heads together)
        const float e = std::exp(w.part_max[p * G + g] - m);
        total += e * w.part_sum[p * G + g];
        const float* pc = w.part_out.data() + (p * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += e * pc[d];
      }
      const float inv = 1.f / total;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
}

// q [B, H, D] fp32; k_cache, v_cache [slots, KVH, D], both fp32, bf16 or fp16; block_tables [B, W];
// context_lens [B]. Returns fp32 [B, H, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens,
                           int64_t block_size, double scale, int64_t sliding_window) {
  TORCH_CHECK(q.dtype() == torch::kFloat32, "paged_decode: q must be fp32");
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype(), "paged_decode: k_cache and v_cache must share a dtype");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.dtype() == torch::kInt64 && context_lens.dtype() == torch::kInt64, "int64 tables");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 || k_cache.scalar_type() == torch::kBFloat16 ||
                  k_cache.scalar_type() == torch::kFloat16,
              "paged_decode: K/V must be fp32, bf16 or fp16, got ", k_cache.scalar_type());
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  PagedDecodeWork work = paged_decode_work(lens.data_ptr<int64_t>(), B, KVH, H / KVH, D, sliding_window);
  const PagedDecodeArgs args{q.data_ptr<float>(), H * D, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.scalar_type(),
                             tables.data_ptr<int64_t>(), tables.size(1), block_size, static_cast<float>(scale),
                             out.data_ptr<float>()};
  const int64_t shares = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), work.units.size()));
  at::parallel_for(0, shares, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const auto [u0, u1] = paged_decode_share(work, s, shares);
      paged_decode_units(work, args, u0, u1);
    }
  });
  if (work.partials > 0)
    at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) { paged_decode_merge(work, out.data_ptr<float>(), begin, end); });
  return out;
}

// The byte offsets share `share` of `shares` of a step's units read, as paged_decode_rows lists them
// for the decode plan's prefetch (tests compare them with the block tables).
torch::Tensor paged_decode_share_rows(torch::Tensor context_lens, torch::Tensor block_tables, int64_t block_size,
                                      int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t sliding_window,
                                      c10::ScalarType dtype, int64_t share, int64_t shares) {
  TORCH_CHECK(block_tables.dtype() == torch::kInt64 && context_lens.dtype() == torch::kInt64 &&
                  block_tables.dim() == 2 && context_lens.numel() == block_tables.size(0),
              "paged_decode_share_rows: int64 block_tables [B, W] and context_lens [B]");
  TORCH_CHECK(shares > 0 && share >= 0 && share < shares, "paged_decode_share_rows: share outside [0, shares)");
  const torch::Tensor tables = block_tables.contiguous(), lens = context_lens.contiguous();
  const int64_t B = tables.size(0);
  const PagedDecodeWork work =
      paged_decode_work(lens.data_ptr<int64_t>(), B, num_kv_heads, group, head_dim, sliding_window);
  const PagedDecodeArgs args{nullptr, 0, nullptr, nullptr, dtype, tables.data_ptr<int64_t>(), tables.size(1),
                             block_size, 0.f, nullptr};
  const auto [u0, u1] = paged_decode_share(work, share, shares);
  const std::vector<int64_t> rows = paged_decode_rows(work, args, u0, u1);
  return torch::tensor(rows, torch::kInt64);
}
