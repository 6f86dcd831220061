// Prompt attention on CPU for several sequences in one call: fp32 q, K and V as a model layer
// gives them, each sequence's queries against an optional run of context keys (all visible:
// a shared prefix, or a chunk's cached positions) and then its own keys, causally.
//
// Work item: (sequence, kv head, run of up to kQueryRun query positions). The keys the run can see
// are copied once per item, transposed, so a vector of scores is FMAs over contiguous lanes (queries,
// values and results are read and written where they are); then per block of kQueryBlock positions,
// its kQueryBlock x G query vectors (the G heads sharing the kv head): scores = Q K^T in register
// tiles, masked, softmax per row, out = P V in register tiles.
// Two passes over a row of scores (not flash's running rescale): prompt rows are short enough
// that a row of scores fits in cache. The loops are written for the compiler's vectoriser
// (-march=native: AVX-512 or AVX2 lanes); the softmax's max and exp are vectorised with AVX-512 or AVX2 where built
// with it. The PyTorch path (kernels/paged_attention.attend) is the reference.
//
// bf16 products (`bf16_products`, where the CPU has AVX512-BF16): q, K, the softmax weights and V rounded to
// bfloat16 (nearest even), each `vdpbf16ps` summing two products into fp32 lanes (twice an fp32 FMA's work);
// scores, softmax and sums stay fp32. K is copied as pairs of dims per key ([D/2, keys] 32-bit words), V as
// pairs of keys per dim ([keys/2, D] words), so one broadcast word of q (or of the weights) meets 16 keys (or
// 16 dims) per instruction.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "isa.h"
#if defined(__AVX2__) && defined(__FMA__)
#include "vec_math.h"
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kQueryBlock = 16;  // query positions per register-tiled block
constexpr int64_t kQueryRun = 256;   // query positions per work item (its keys copied once)
constexpr int64_t kLane = 16;        // floats per vector
constexpr int64_t kScoreRows = 6, kScoreVecs = 2;  // scores register tile: 6 query vectors x 32 keys
constexpr int64_t kOutRows = 4;                    // output register tile: 4 query vectors x (4 or 1) x 16 dims

// 16 floats as one value (GCC/Clang vector extension: AVX-512, two AVX2 registers, or whatever the target has)
typedef float vec16 __attribute__((vector_size(64)));
typedef float vec16u __attribute__((vector_size(64), aligned(4)));
inline vec16 load16(const float* p) { return *reinterpret_cast<const vec16u*>(p); }
inline void store16(float* p, vec16 v) { *reinterpret_cast<vec16u*>(p) = v; }

struct Segment {
  int64_t q_start, q_len, ctx_start, ctx_len, own_start;
};


// the largest of s[0..n), n >= 1
inline float row_max(const float* s, int64_t n) {
  int64_t i = 0;
  float m = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + i));
  m = _mm512_reduce_max_ps(vm);
#endif
  for (; i < n; ++i) m = std::max(m, s[i]);
  return m;
}

// s[0..n) = exp(s - m) in place; returns the sum
inline float exp_shifted(float* s, int64_t n, float m) {
  float sum = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  {
    const __m512 vm = _mm512_set1_ps(m);
    __m512 acc = _mm512_setzero_ps();
    for (; i < n; i += 16) {
      const __mmask16 k = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), vm));
      _mm512_mask_storeu_ps(s + i, k, e);
      acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
    }
    return _mm512_reduce_add_ps(acc);
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum8(acc);
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  return sum;
}

// out rows r0.. (kOutRows of them) = p V over keys 0..hi, NB vectors of 16 dims from d0
template <int NB>
inline void values_tile(const float* scores, int64_t ldk, const float* const* v_rows, int64_t hi, int64_t d0,
                        vec16 (&acc)[kOutRows][NB]) {
  for (int64_t r = 0; r < kOutRows; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = vec16{};
  for (int64_t j = 0; j <= hi; ++j) {
    vec16 vj[NB];
    for (int b = 0; b < NB; ++b) vj[b] = load16(v_rows[j] + d0 + b * kLane);
    for (int64_t r = 0; r < kOutRows; ++r) {
      const float p = scores[r * ldk + j];
      for (int b = 0; b < NB; ++b) acc[r][b] += p * vj[b];
    }
  }
}

// One block of queries: rows `q_rows[r]` (D floats each, Mp of them; from M on a zero row) against keys 0..ldk-1 of `kt` [D, ldkt]
// (transposed; ldk <= ldkt a multiple of kScoreVecs * kLane, zero past the keys), value j at `v_rows[j]`; `first_visible[r]`/`last_visible[r]`: the key range query
// vector r may see (inclusive). Scores are q . k times `scale`; `scores` [Mp, ldk]; row r of the result to `out_rows[r]`.
void attend_item(const float* const* q_rows, float scale, int64_t M, int64_t Mp, int64_t D, const float* kt,
                 int64_t ldkt, int64_t ldk, const float* const* v_rows, const int64_t* first_visible, const int64_t* last_visible,
                 float* scores, float* const* out_rows) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // scores[r, j] = q_r . k_j
  for (int64_t r0 = 0; r0 < Mp; r0 += kScoreRows)
    for (int64_t j0 = 0; j0 < ldk; j0 += kScoreVecs * kLane) {
      vec16 acc[kScoreRows][kScoreVecs] = {};
      for (int64_t d = 0; d < D; ++d) {
        vec16 kd[kScoreVecs];
        for (int64_t b = 0; b < kScoreVecs; ++b) kd[b] = load16(kt + d * ldkt + j0 + b * kLane);
        for (int64_t r = 0; r < kScoreRows; ++r) {
          const float qd = q_rows[r0 + r][d];
          for (int64_t b = 0; b < kScoreVecs; ++b) acc[r][b] += qd * kd[b];
        }
      }
      for (int64_t r = 0; r < kScoreRows; ++r)
        for (int64_t b = 0; b < kScoreVecs; ++b) store16(scores + (r0 + r) * ldk + j0 + b * kLane, acc[r][b] * scale);
    }
  // softmax over each row's visible keys; the rest (and the padding rows) weigh 0
  std::vector<float> inv_sums(Mp, 0.f);
  for (int64_t r = 0; r < Mp; ++r) {
    float* s = scores + r * ldk;
    if (r >= M) {
      std::fill(s, s + ldk, 0.f);
      continue;
    }
    const int64_t lo = first_visible[r], hi = last_visible[r];
    for (int64_t j = 0; j < lo; ++j) s[j] = 0.f;
    for (int64_t j = hi + 1; j < ldk; ++j) s[j] = 0.f;
    inv_sums[r] = 1.f / exp_shifted(s + lo, hi - lo + 1, row_max(s + lo, hi - lo + 1));
  }
  // out[r] = sum_j p[r, j] v_j / sum_r
  for (int64_t r0 = 0; r0 < M; r0 += kOutRows) {
    int64_t hi = 0;
    for (int64_t r = r0; r < std::min(r0 + kOutRows, M); ++r) hi = std::max(hi, last_visible[r]);
    const float* p = scores + r0 * ldk;
    auto emit = [&](int64_t d0, const vec16* acc_row, int64_t r, int nb) {
      for (int b = 0; b < nb; ++b) store16(out_rows[r0 + r] + d0 + b * kLane, acc_row[b] * inv_sums[r0 + r]);
    };
    int64_t d0 = 0;
    for (; d0 + 4 * kLane <= D; d0 += 4 * kLane) {
      vec16 acc[kOutRows][4];
      values_tile<4>(p, ldk, v_rows, hi, d0, acc);
      for (int64_t r = 0; r < kOutRows && r0 + r < M; ++r) emit(d0, acc[r], r, 4);
    }
    for (; d0 < D; d0 += kLane) {
      vec16 acc[kOutRows][1];
      values_tile<1>(p, ldk, v_rows, hi, d0, acc);
      for (int64_t r = 0; r < kOutRows && r0 + r < M; ++r) emit(d0, acc[r], r, 1);
    }
  }
}

#if LLMOPT_COMPILED_BF16_DOT
typedef uint32_t bf16_pair;  // two bfloat16 values: the lower-indexed one in the low 16 bits

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

// 16 floats rounded to bf16 (nearest even), each in the low half of a 32-bit lane
inline __m512i bf16_lanes(const float* p) {
  const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(p));
  return _mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(h));
}

// row x of D floats as D/2 pairs (D a multiple of 16)
inline void to_pairs(const float* x, int64_t D, bf16_pair* out) {
  for (int64_t d = 0; d < D; d += kLane) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + d));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d / 2), reinterpret_cast<const __m256i&>(h));
  }
}

// out rows r0.. (kOutRows of them) = p V over key pairs 0..pairs-1, NB vectors of 16 dims from d0; `wp` the rows'
// weights as pairs (row stride ldw words), `vp` [pairs, D] the values' pairs of keys
template <int NB>
inline void value_pairs_tile(const bf16_pair* wp, int64_t ldw, const bf16_pair* vp, int64_t D, int64_t pairs,
                             int64_t d0, __m512 (&acc)[kOutRows][NB]) {
  for (int64_t r = 0; r < kOutRows; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t jp = 0; jp < pairs; ++jp) {
    __m512bh vj[NB];
    for (int b = 0; b < NB; ++b) vj[b] = as_bh(_mm512_loadu_si512(vp + jp * D + d0 + b * kLane));
    for (int64_t r = 0; r < kOutRows; ++r) {
      const __m512bh pr = as_bh(_mm512_set1_epi32(static_cast<int>(wp[r * ldw + jp])));
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], pr, vj[b]);
    }
  }
}

// One block of queries as attend_item, products in bf16: `qp` [Mp, D/2] the queries' pairs (zero rows from M on),
// `ktp` [D/2, ldkt] the keys' pairs of dims, `vp` [ldkt/2, D] the values' pairs of keys (zero past the keys);
// `weights` [Mp, ldk] bf16 scratch.
void attend_item_bf16(const bf16_pair* qp, float scale, int64_t M, int64_t Mp, int64_t D, const bf16_pair* ktp,
                      int64_t ldkt, int64_t ldk, const bf16_pair* vp, const int64_t* first_visible,
                      const int64_t* last_visible, float* scores, uint16_t* weights, float* const* out_rows) {
  const int64_t half_d = D / 2;
  for (int64_t r0 = 0; r0 < Mp; r0 += kScoreRows)
    for (int64_t j0 = 0; j0 < ldk; j0 += kScoreVecs * kLane) {
      __m512 acc[kScoreRows][kScoreVecs];
      for (int64_t r = 0; r < kScoreRows; ++r)
        for (int64_t b = 0; b < kScoreVecs; ++b) acc[r][b] = _mm512_setzero_ps();
      for (int64_t dp = 0; dp < half_d; ++dp) {
        __m512bh kd[kScoreVecs];
        for (int64_t b = 0; b < kScoreVecs; ++b) kd[b] = as_bh(_mm512_loadu_si512(ktp + dp * ldkt + j0 + b * kLane));
        for (int64_t r = 0; r < kScoreRows; ++r) {
          const __m512bh qd = as_bh(_mm512_set1_epi32(static_cast<int>(qp[(r0 + r) * half_d + dp])));
          for (int64_t b = 0; b < kScoreVecs; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], qd, kd[b]);
        }
      }
      const __m512 vscale = _mm512_set1_ps(scale);
      for (int64_t r = 0; r < kScoreRows; ++r)
        for (int64_t b = 0; b < kScoreVecs; ++b)
          _mm512_storeu_ps(scores + (r0 + r) * ldk + j0 + b * kLane, _mm512_mul_ps(acc[r][b], vscale));
    }
  // softmax in fp32 over each row's visible keys (the rest, and the padding rows, weigh 0), the weights rounded
  std::vector<float> inv_sums(Mp, 0.f);
  for (int64_t r = 0; r < Mp; ++r) {
    float* s = scores + r * ldk;
    if (r >= M) {
      std::fill(s, s + ldk, 0.f);
    } else {
      const int64_t lo = first_visible[r], hi = last_visible[r];
      for (int64_t j = 0; j < lo; ++j) s[j] = 0.f;
      for (int64_t j = hi + 1; j < ldk; ++j) s[j] = 0.f;
      inv_sums[r] = 1.f / exp_shifted(s + lo, hi - lo + 1, row_max(s + lo, hi - lo + 1));
    }
    to_pairs(s, ldk, reinterpret_cast<bf16_pair*>(weights + r * ldk));
  }
  // out[r] = sum_j p[r, j] v_j / sum_r, two keys per instruction
  const bf16_pair* wp = reinterpret_cast<const bf16_pair*>(weights);
  const int64_t half_ldk = ldk / 2;
  for (int64_t r0 = 0; r0 < M; r0 += kOutRows) {
    int64_t hi = 0;
    for (int64_t r = r0; r < std::min(r0 + kOutRows, M); ++r) hi = std::max(hi, last_visible[r]);
    const int64_t pairs = std::min(half_ldk, hi / 2 + 1);
    auto emit = [&](int64_t d0, const __m512* acc_row, int64_t r, int nb) {
      const __m512 inv = _mm512_set1_ps(inv_sums[r0 + r]);
      for (int b = 0; b < nb; ++b) _mm512_storeu_ps(out_rows[r0 + r] + d0 + b * kLane, _mm512_mul_ps(acc_row[b], inv));
    };
    int64_t d0 = 0;
    for (; d0 + 4 * kLane <= D; d0 += 4 * kLane) {
      __m512 acc[kOutRows][4];
      value_pairs_tile<4>(wp + r0 * half_ldk, half_ldk, vp, D, pairs, d0, acc);
      for (int64_t r = 0; r < kOutRows && r0 + r < M; ++r) emit(d0, acc[r], r, 4);
    }
    for (; d0 < D; d0 += kLane) {
      __m512 acc[kOutRows][1];
      value_pairs_tile<1>(wp + r0 * half_ldk, half_ldk, vp, D, pairs, d0, acc);
      for (int64_t r = 0; r < kOutRows && r0 + r < M; ++r) emit(d0, acc[r], r, 1);
    }
  }
}

// The keys' pairs of dims [D/2, ldk] and the values' pairs of keys [ldk/2, D], zero past the nk keys.
void copy_pairs(const float* const* key_rows, const float* const* value_rows, int64_t nk, int64_t ldk, int64_t D,
                std::vector<uint32_t>& kt_pairs, std::vector<uint32_t>& v_pairs) {
  const int64_t half_d = D / 2;
  kt_pairs.assign(half_d * ldk, 0u);
  v_pairs.resize(ldk / 2 * D);
  std::vector<bf16_pair> row(half_d);
  for (int64_t j = 0; j < nk; ++j) {
    to_pairs(key_rows[j], D, row.data());
    for (int64_t dp = 0; dp < half_d; ++dp) kt_pairs[dp * ldk + j] = row[dp];
  }
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t jp = 0; jp < ldk / 2; ++jp) {
    const int64_t j = 2 * jp;
    for (int64_t d = 0; d < D; d += kLane) {
      const __m512i lo = j < nk ? bf16_lanes(value_rows[j] + d) : zero;
      const __m512i hi = j + 1 < nk ? bf16_lanes(value_rows[j + 1] + d) : zero;
      _mm512_storeu_si512(v_pairs.data() + jp * D + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}
#endif

}  // namespace

// Whether this build and CPU take bf16 products now (AVX512-BF16 compiled and present, the AVX-512 path active).
bool bf16_products_available() { return llmopt_isa::bf16_dot_active(); }

// q [Tq, H, D], k and v [Tk, KVH, D], fp32 contiguous; segments [S, 5] int64: per sequence
// (q_start, q_len, ctx_start, ctx_len, own_start): its queries are rows q_start.. of q, its
// context keys rows ctx_start.. of k and v (ctx_len of them, all visible), its own keys rows
// own_start.. (q_len of them, causal). sliding_window > 0: a query at position p (ctx_len + i)
// sees only keys at positions > p - window. bf16_products: the products in bf16 (`bf16_products_available`).
// Returns [Tq, H, D].
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor segments,
                                double scale, int64_t sliding_window, bool bf16_products) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [tokens, heads, head_dim]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat && v.scalar_type() == torch::kFloat,
              "prefill_attention takes fp32 q, k, v");
  TORCH_CHECK(segments.scalar_type() == torch::kLong && segments.dim() == 2 && segments.size(1) == 5,
              "segments must be int64 [S, 5]");
  q = q.contiguous(), k = k.contiguous(), v = v.contiguous(), segments = segments.contiguous();
  const int64_t H = q.size(1), D = q.size(2), KVH = k.size(1), Tk = k.size(0);
  TORCH_CHECK(KVH > 0 && H % KVH == 0 && v.sizes() == k.sizes() && k.size(2) == D, "inconsistent q, k, v shapes");
  TORCH_CHECK(D % kLane == 0, "head_dim must be a multiple of ", kLane);
  TORCH_CHECK(!bf16_products || bf16_products_available(), "bf16 products need AVX512-BF16 (and the AVX-512 path)");
  const int64_t G = H / KVH;
  const int64_t S = segments.size(0);
  std::vector<Segment> segs(S);
  const int64_t* sp = segments.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {
    segs[s] = {sp[5 * s], sp[5 * s + 1], sp[5 * s + 2], sp[5 * s + 3], sp[5 * s + 4]};
    const Segment& g = segs[s];
    TORCH_CHECK(g.q_start >= 0 && g.q_len >= 0 && g.q_start + g.q_len <= q.size(0), "segment ", s, ": queries out of range");
    TORCH_CHECK(g.ctx_len == 0 || (g.ctx_start >= 0 && g.ctx_start + g.ctx_len <= Tk), "segment ", s, ": context out of range");
    TORCH_CHECK(g.own_start >= 0 && g.own_start + g.q_len <= Tk, "segment ", s, ": keys out of range");
  }
  // items: (segment, kv head, run of up to kQueryRun query positions); an item copies the keys its run sees once.
  // Their costs differ by orders of magnitude (a 400-token question beside 40-token ones, a shared header), so the
  // threads take them from one queue, largest first, rather than in fixed halves of the list.
  std::vector<std::array<int64_t, 4>> items;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t i0 = 0; i0 < segs[s].q_len; i0 += kQueryRun)
        items.push_back({s, h, i0, std::min(i0 + kQueryRun, segs[s].q_len)});
  const auto item_cost = [&](const std::array<int64_t, 4>& item) {  // query positions x keys they see, roughly
    return (item[3] - item[2]) * (segs[item[0]].ctx_len + (item[2] + item[3]) / 2);
  };
  std::stable_sort(items.begin(), items.end(),
                   [&](const auto& a, const auto& b) { return item_cost(a) > item_cost(b); });
  std::atomic<int64_t> next_item{0};
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  constexpr int64_t kKeyTile = kScoreVecs * kLane;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> kt, scores;
    std::vector<uint32_t> kt_pairs, v_pairs, q_pairs;  // the bf16 path's copies
    std::vector<uint16_t> weights;
    const std::vector<float> zero_row(D, 0.f);  // the padding query rows'
    std::vector<int64_t> first, last;
    std::vector<const float*> key_rows, value_rows, q_rows;
    std::vector<float*> out_rows;
    for (int64_t it = next_item++; it < static_cast<int64_t>(items.size()); it = next_item++) {
      const auto [s, h, run_begin, run_end] = items[it];
      const Segment& g = segs[s];
      // positions: context keys 0..ctx_len-1, own keys ctx_len..; query i at ctx_len + i
      const int64_t top = g.ctx_len + run_end - 1;  // the last position a query of the run sees
      const int64_t bottom = sliding_window > 0 ? std::max<int64_t>(0, g.ctx_len + run_begin - sliding_window + 1) : 0;
      const int64_t nk = top - bottom + 1, ldk = (nk + kKeyTile - 1) / kKeyTile * kKeyTile;
      key_rows.resize(nk), value_rows.resize(nk);
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t p = bottom + j;
        const int64_t row = p < g.ctx_len ? g.ctx_start + p : g.own_start + (p - g.ctx_len);
        key_rows[j] = kp + (row * KVH + h) * D;
        value_rows[j] = vp + (row * KVH + h) * D;
      }
      if (bf16_products) {  // only where compiled (bf16_products_available)
#if LLMOPT_COMPILED_BF16_DOT
        copy_pairs(key_rows.data(), value_rows.data(), nk, ldk, D, kt_pairs, v_pairs);
#endif
      } else {
        kt.resize(D * ldk);
        for (int64_t d = 0; d < D; ++d) {
          float* row = kt.data() + d * ldk;
          for (int64_t j = 0; j < nk; ++j) row[j] = key_rows[j][d];
          std::fill(row + nk, row + ldk, 0.f);  // padding keys score 0 (and weigh 0)
        }
      }
      for (int64_t i0 = run_begin; i0 < run_end; i0 += kQueryBlock) {
        const int64_t qb = std::min(kQueryBlock, run_end - i0), M = qb * G;
        const int64_t Mp = (M + 11) / 12 * 12;  // rows padded for both register tiles (the scores' 6, the output's 4)
        const int64_t block_keys = g.ctx_len + i0 + qb - bottom;  // keys 0..block_keys-1 of the run's copy
        const int64_t block_ldk = std::min(ldk, (block_keys + kKeyTile - 1) / kKeyTile * kKeyTile);
        scores.resize(Mp * block_ldk), first.resize(M), last.resize(M), out_rows.resize(M);
        q_rows.assign(Mp, zero_row.data());
        // query vector r = (position i, head gi of the kv head's group): read from q and written to out in place
        for (int64_t i = 0; i < qb; ++i)
          for (int64_t gi = 0; gi < G; ++gi) {
            const int64_t r = i * G + gi, pos = g.ctx_len + i0 + i, offset = ((g.q_start + i0 + i) * H + h * G + gi) * D;
            q_rows[r] = qp + offset;
            out_rows[r] = op + offset;
            first[r] = sliding_window > 0 ? std::max<int64_t>(0, pos - sliding_window + 1) - bottom : 0;
            last[r] = pos - bottom;
          }
        if (bf16_products) {
#if LLMOPT_COMPILED_BF16_DOT
          q_pairs.assign(Mp * D / 2, 0u);
          weights.resize(Mp * block_ldk);
          for (int64_t r = 0; r < M; ++r) to_pairs(q_rows[r], D, q_pairs.data() + r * D / 2);
          attend_item_bf16(q_pairs.data(), fscale, M, Mp, D, kt_pairs.data(), ldk, block_ldk, v_pairs.data(),
                           first.data(), last.data(), scores.data(), weights.data(), out_rows.data());
#endif
        } else {
          attend_item(q_rows.data(), fscale, M, Mp, D, kt.data(), ldk, block_ldk, value_rows.data(), first.data(),
                      last.data(), scores.data(), out_rows.data());
        }
      }
    }
  });
  return out;
}
