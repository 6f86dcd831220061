// y = x @ dequant(W).T (+ bias) for 4-bit AWQ / GPTQ weights on CPU, fp32 in and out.
//
// Decode reads every weight once per step, so the bytes of the weights set the floor: 4-bit
// codes are 8x fewer than fp32. The activations are quantized on the fly to int8, one scale
// per 32 values (llama.cpp's Q8_1 for its Q4_1 x Q8_1 dot product), so weights meet them in
// integer dot products (u8 codes x s8 activations). With fp32 activations every weight would
// need its own convert-and-FMA instead (~3x the instructions); the int8 rounding costs a KLD
// measured in docs/benchmarks.md.
//
// Weight layout (repacked once at load by kernels/cpu_int4.py): output rows in tiles of 8,
// interleaved so that one 32-byte load holds 4 consecutive codes of each of the 8 rows (low
// nibbles) and 4 more, 16 columns on (high nibbles): 4 loads and a mask/shift give 8 vectors,
// each the 8 rows' codes for 4 consecutive columns, which meet a broadcast of the matching 4
// activation bytes, so the 8 rows' dot products land in 8 lanes: no horizontal sums, and the
// group scales of 8 rows are one vector. Groups are contiguous runs of `group_blocks` blocks
// of 32 columns with a scale s and zero point per row: w = (code - zero) * s, so a group's dot
// product is s * sum(code * x) - s * zero * sum(x), the second term from the activations' block
// sums. The scales and zeros come in one of two layouts (`Int4Weights::compact`): fp16 scales and
// uint8 zeros (3 bytes a group and row: what AWQ / GPTQ checkpoints and Q4_0 hold), or fp32 scales
// and fp32 s * zero (8 bytes) for weights whose scales are not fp16 values. At batch 1 the weights'
// bytes set the time, and the compact layout is 58 of the 66 MB a step of the default AWQ model
// reads in its projections. Both give bitwise the same results: s * zero is formed in fp32 from
// the fp16 scale (11 significant bits) and the zero (at most 8), which is exact.
//
// Three paths compute the integer block dot products, chosen at run time (csrc/isa.h):
// - avx2: maddubs (u8 x s8 -> s16 pairs; the 8 results add up without overflow,
//   |sum| <= 8 * 2 * 15 * 127 < 2^15) and one madd to s32; 8 rows (one tile) per vector.
// - avx512 (AVX-512 VNNI): dpbusd (u8 x s8, 4 products into s32) on 16 lanes, two tiles side
//   by side in one register, a few rows of x per weight load. Decode and batched decode.
// - amx (AMX-INT8): for many rows of x (prompt chunks, >= kAmxMinRows), tdpbssd multiplies 16
//   rows of x by a 16-output-row block of codes unpacked to bytes, one 32-column block per tile
//   product, and AVX-512 scales each block's 16 x 16 integer results in fp32.
// Integer dot products are exact, and every path then does the same fp32 arithmetic per output
// element in the same order (per block: float(dot) times the product scale_w * scale_x, one
// FMA into the element's accumulator; per group one FMA for the zero term; at the end acc -
// zero term): every output element is bitwise the same whatever the path, the tile it falls in
// and however many rows x has. A sequence's result does not depend on the rest of the batch,
// prompt chunks and decode steps compute a token's projections identically, and a machine's
// paths agree bitwise (tests/test_cpu_int4.py runs each one this CPU has).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>
#include "isa.h"
#include "prefetch.h"
#include "team.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using llmopt_isa::kAmx;
using llmopt_isa::kAvx2;
using llmopt_isa::kAvx512;

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 8;  // output rows interleaved together

// Rows of x from which the AMX path is taken: at and above it, measured faster than the VNNI
// path on the default model's projections (docs/benchmarks.md, "int4 kernel paths").
constexpr int64_t kAmxMinRows = 32;
constexpr int64_t kAmxRows = 16;  // rows of x per tile product

// Rows of x the VNNI path takes against a span's tiles at a time (a multiple of 8, its register tile).
constexpr int64_t kRowRun = 64;

// Rows of x from which int8 weights (the vocabulary projection's Q8_0 copy) take the VNNI path (its
// results are bitwise AVX2's). The 49,152 x 576 projection on Zen 4, weights out of cache, AVX2's
// maddubs path / VNNI: 1 row 0.62-0.67 / 0.66-0.71 ms, 2 rows 0.63-0.67 / 0.55-0.57, 4 rows 1.05-1.07 /
// 0.61-0.64 (scripts/bench_decode_plan.py; docs/benchmarks.md).
constexpr int64_t kInt8VnniMinRows = 2;

// Decode reads each weight once. With only the dot products' own loads in flight, a core waited on
// memory and then computed, one after the other (one row of x on Zen 4: ~10 GB/s per core from DRAM
// against ~35 GB/s with the same weights in cache); asking for the codes kPrefetchAhead bytes before
// they are used, into L2, keeps enough lines in flight to overlap the two (a 33 MB projection at one
// row, 2 threads: 16-21 -> 40-60 GB/s; docs/benchmarks.md, "int4 and int8 weights
// prefetched into L2"). A thread's span
// also starts with one burst of prefetches over its first kPrefetchAhead bytes, so short spans (the
// small projections of a small model) are not waiting on their first lines one at a time. Addresses past
// the end of the weights are harmless: a prefetch never faults.
constexpr int64_t kPrefetchAhead = 8192;

// A side stream's bytes (csrc/prefetch.h) asked for per block of K per row of x: at 8 rows the pair
// kernel spends ~100 cycles on a block, and ~5 bytes a cycle from each of 2 cores is about what such
// scattered reads get beside the weights' stream. The decode plan at 8 rows x 512 positions of fp32
// K/V (Zen 4, 2 threads, one build, the stream on / off in turn): 11.9-12.2 -> 10.2-11.0 ms a step at
// 64 bytes; 48 bytes gained less (-> 11.1-11.3), 96 and more lost time waiting on the stream.
constexpr int64_t kSideBytesPerRow = 64;
using llmopt_prefetch::prefetch_l2;
using llmopt_prefetch::prefetch_span;

// Activations of M rows quantized per 32-value block: codes, block scales, each block's sum of
// codes, and per weight group the sum over its blocks of scale * sum(codes) (the zero-point term's
// factor). Rows from M up to `rows` (a multiple of the AMX tile height when that path runs) are zeros.
struct QuantizedRows {
  std::vector<int8_t> q;      // [rows, K]
  std::vector<float> d;       // [rows, K / 32]
  std::vector<float> gsum;    // [rows, groups]
  std::vector<int32_t> qsum;  // [rows, K / 32]
};

// d = max|x| / 127, q = round-half-even(x * (1 / d)): two correctly rounded fp32 operations,
// so the PyTorch reference in kernels/cpu_int4.py reproduces the codes exactly.
inline void quantize_block_scalar(const float* x, int8_t* q, float* d_out, int32_t* sum_out) {
  float amax = 0.f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  int32_t sum = 0;
  for (int i = 0; i < kBlock; ++i) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(x[i] * id));
    q[i] = static_cast<int8_t>(v);
    sum += v;
  }
  *d_out = d;
  *sum_out = sum;
}

#if LLMOPT_COMPILED_AVX512
// quantize_block_scalar with 16-float lanes: the same max, the same two fp32 operations, and
// cvtps's round-half-even (the default rounding mode, nearbyint's): bitwise the same codes
inline void quantize_block_avx512(const float* x, int8_t* q, float* d_out, int32_t* sum_out) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float d = amax / 127.f;
  const __m512 id = _mm512_set1_ps(d != 0.f ? 1.f / d : 0.f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, id)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, id));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  *d_out = d;
  *sum_out = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}
#endif

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K, int64_t group_blocks, const int64_t* perm,
                            int64_t rows, int isa) {
#if LLMOPT_COMPILED_AVX512
  const auto quantize_block = isa >= kAvx512 ? quantize_block_avx512 : quantize_block_scalar;
#else
  const auto quantize_block = quantize_block_scalar;
#endif
  const int64_t nb = K / kBlock, groups = nb / group_blocks;
  QuantizedRows r{std::vector<int8_t>(rows * K), std::vector<float>(rows * nb), std::vector<float>(rows * groups),
                  std::vector<int32_t>(rows * nb)};
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(perm != nullptr ? K : 0);
    for (int64_t m = begin; m < end; ++m) {
      const float* xr = x + m * K;
      if (perm != nullptr) {  // act-order checkpoints: columns in the order the groups were stored
        for (int64_t k = 0; k < K; ++k) row[k] = xr[perm[k]];
        xr = row.data();
      }
      for (int64_t g = 0; g < groups; ++g) {
        float gs = 0.f;
        for (int64_t b = g * group_blocks; b < (g + 1) * group_blocks; ++b) {
          int32_t sum;
          quantize_block(xr + b * kBlock, r.q.data() + m * K + b * kBlock, r.d.data() + m * nb + b, &sum);
          r.qsum[m * nb + b] = sum;
          gs = std::fma(r.d[m * nb + b], static_cast<float>(sum), gs);
        }
        r.gsum[m * groups + g] = gs;
      }
    }
  });
  return r;
}

struct Int4Weights {
  const uint8_t* codes;  // [N / 8, K / 32, 128]: tile, block, interleaved bytes
  const void* scales;    // [N / 8, groups, 8]: fp16 (compact) or fp32
  const void* zeros;     // [N / 8, groups, 8]: uint8 zero (compact) or fp32 scale * zero
  int64_t K, groups, group_blocks;
  bool compact;

  int64_t scale_bytes() const { return compact ? 2 : 4; }
  int64_t zero_bytes() const { return compact ? 1 : 4; }
  const char* scale_ptr(int64_t i) const { return static_cast<const char*>(scales) + i * scale_bytes(); }
  const char* zero_ptr(int64_t i) const { return static_cast<const char*>(zeros) + i * zero_bytes(); }
  // entry i = (tile * groups + group) * 8 + row
  float scale(int64_t i) const {
    return compact ? static_cast<float>(c10::Half(static_cast<const uint16_t*>(scales)[i], c10::Half::from_bits()))
                   : static_cast<const float*>(scales)[i];
  }
  float scaled_zero(int64_t i) const {
    return compact ? scale(i) * static_cast<float>(static_cast<const uint8_t*>(zeros)[i])
                   : static_cast<const float*>(zeros)[i];
  }
};

struct Int8Weights {
  const int8_t* codes;  // [N / 8, K / 32, 256]: tile, block, 8 chunks of 4 columns x 8 rows
  const float* scales;  // [N / 8, K / 32, 8]
  int64_t K;
};

// ---- portable C++: the same blocks, sums and fp32 order, one element at a time ----

template <int MT>
inline void int4_tile_scalar(const Int4Weights& W, int64_t t, const QuantizedRows& X, int64_t m0, float* out,
                             int64_t ldo) {
  const int64_t K = W.K, G = W.groups, nb = K / kBlock;
  const uint8_t* codes = W.codes + t * nb * 128;
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kTile; ++r) {
      const int8_t* x = X.q.data() + (m0 + m) * K;
      float acc = 0.f, zacc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const float s = W.scale((t * G + g) * kTile + r);
        for (int64_t b = g * W.group_blocks; b < (g + 1) * W.group_blocks; ++b) {
          int32_t dot = 0;
          for (int c = 0; c < 4; ++c)
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = codes[b * 128 + c * 32 + r * 4 + i];
              dot += (byte & 0x0F) * x[b * kBlock + c * 4 + i] + (byte >> 4) * x[b * kBlock + 16 + c * 4 + i];
            }
          acc = std::fma(static_cast<float>(dot), s * X.d[(m0 + m) * nb + b], acc);
        }
        zacc = std::fma(W.scaled_zero((t * G + g) * kTile + r), X.gsum[(m0 + m) * G + g], zacc);
      }
      out[m * ldo + r] = acc - zacc;
    }
}

template <int MT>
inline void int8_tile_scalar(const Int8Weights& W, int64_t t, const QuantizedRows& X, int64_t m0, float* out,
                             int64_t ldo) {
  const int64_t K = W.K, nb = K / kBlock;
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kTile; ++r) {
      const int8_t* x = X.q.data() + (m0 + m) * K;
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot = 0;
        for (int c = 0; c < 8; ++c)
          for (int i = 0; i < 4; ++i) dot += W.codes[(t * nb + b) * 256 + c * 32 + r * 4 + i] * x[b * kBlock + c * 4 + i];
        acc = std::fma(static_cast<float>(dot), W.scales[(t * nb + b) * kTile + r] * X.d[(m0 + m) * nb + b], acc);
      }
      out[m * ldo + r] = acc;
    }
}

// ---- AVX2 ----

#if defined(__AVX2__) && defined(__FMA__)

// the 8 rows' scales (entries i..i+7) and scale * zero
inline __m256 scales8(const Int4Weights& W, int64_t i) {
#ifdef __F16C__
  if (W.compact) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(W.scale_ptr(i))));
#endif
  if (W.compact) {
    alignas(32) float v[kTile];
    for (int r = 0; r < kTile; ++r) v[r] = W.scale(i + r);
    return _mm256_load_ps(v);
  }
  return _mm256_loadu_ps(reinterpret_cast<const float*>(W.scale_ptr(i)));
}

inline __m256 scaled_zeros8(const Int4Weights& W, int64_t i, __m256 scales) {
  if (W.compact)
    return _mm256_mul_ps(scales, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                     _mm_loadl_epi64(reinterpret_cast<const __m128i*>(W.zero_ptr(i))))));
  return _mm256_loadu_ps(reinterpret_cast<const float*>(W.zero_ptr(i)));
}

// the 8 output rows of tile `t` against MT rows of x (from m0); out has row stride ldo
template <int MT>
inline void int4_tile_avx2(const Int4Weights& W, int64_t t, const QuantizedRows& X, int64_t m0, float* out,
                           int64_t ldo, llmopt_prefetch::RowStream* side = nullptr) {
  const int64_t K = W.K, G = W.groups, nb = K / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[MT], zacc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = zacc[m] = _mm256_setzero_ps();
  const uint8_t* codes = W.codes + t * nb * 128;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t i = (t * G + g) * kTile;
    const __m256 vs = scales8(W, i);
    prefetch_l2(W.scale_ptr(i) + kPrefetchAhead / 8);
    prefetch_l2(W.zero_ptr(i) + kPrefetchAhead / 8);
    for (int64_t b = g * W.group_blocks; b < (g + 1) * W.group_blocks; ++b) {
      prefetch_span(codes + b * 128 + kPrefetchAhead, 128);
      if (side != nullptr) side->issue(MT * kSideBytesPerRow);
      __m256i w[8];  // w[j]: columns 4j..4j+3 of the block, 4 bytes per row
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + b * 128 + c * 32));
        w[c] = _mm256_and_si256(v, low);
        w[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      for (int m = 0; m < MT; ++m) {
        const int8_t* xb = X.q.data() + (m0 + m) * K + b * kBlock;
        const int32_t* x4 = reinterpret_cast<const int32_t*>(xb);
        __m256i s16 = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(x4[0]));
        for (int j = 1; j < 8; ++j) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(x4[j])));
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
        acc[m] = _mm256_fmadd_ps(dot, _mm256_mul_ps(vs, _mm256_set1_ps(X.d[(m0 + m) * nb + b])), acc[m]);
      }
    }
    const __m256 vz = scaled_zeros8(W, i, vs);
    for (int m = 0; m < MT; ++m) zacc[m] = _mm256_fmadd_ps(vz, _mm256_set1_ps(X.gsum[(m0 + m) * G + g]), zacc[m]);
  }
  for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out + m * ldo, _mm256_sub_ps(acc[m], zacc[m]));
}

// Symmetric 8-bit weights (llama.cpp's Q8_0: one scale per 32 columns) against int8
// activations: maddubs needs an unsigned operand, so |w| meets x with w's sign moved onto it
// (|w|, |x| <= 127: a pair's sum stays below 2^15).
template <int MT>
inline void int8_tile_avx2(const Int8Weights& W, int64_t t, const QuantizedRows& X, int64_t m0, float* out,
                           int64_t ldo) {
  const int64_t K = W.K, nb = K / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* wb = W.codes + (t * nb + b) * 256;
    prefetch_span(wb + kPrefetchAhead, 256);
    prefetch_l2(reinterpret_cast<const char*>(W.scales + (t * nb + b) * kTile) + kPrefetchAhead / 8);
    __m256i dot[MT];
    for (int m = 0; m < MT; ++m) dot[m] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + c * 32));
      const __m256i aw = _mm256_sign_epi8(w, w);
      for (int m = 0; m < MT; ++m) {
        const int32_t* x4 = reinterpret_cast<const int32_t*>(X.q.data() + (m0 + m) * K + b * kBlock);
        const __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(x4[c]), w);
        dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones));
      }
    }
    const __m256 vs = _mm256_loadu_ps(W.scales + (t * nb + b) * kTile);
    for (int m = 0; m < MT; ++m)
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]), _mm256_mul_ps(vs, _mm256_set1_ps(X.d[(m0 + m) * nb + b])),
                               acc[m]);
  }
  for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out + m * ldo, acc[m]);
}

#endif

// ---- AVX-512 VNNI ----

#if LLMOPT_COMPILED_AVX512

// two 32-byte halves (tile t and tile t + 1, same block and chunk) in one register
inline __m512i load_pair(const uint8_t* a, const uint8_t* b) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
}

inline __m512 load_pair_ps(const float* a, const float* b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps(a))),
                                             _mm256_castps_pd(_mm256_loadu_ps(b)), 1));
}

// the scales of tiles t and t + 1 (entries i and j = i + groups * 8) in lanes 0-7 and 8-15, and scale * zero
inline __m512 scales_pair(const Int4Weights& W, int64_t i, int64_t j) {
  if (W.compact)
    return _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(W.scale_ptr(i)))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(W.scale_ptr(j))), 1));
  return load_pair_ps(reinterpret_cast<const float*>(W.scale_ptr(i)), reinterpret_cast<const float*>(W.scale_ptr(j)));
}

inline __m512 scaled_zeros_pair(const Int4Weights& W, int64_t i, int64_t j, __m512 scales) {
  if (W.compact) {
    const __m128i z = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(W.zero_ptr(i))),
                                         _mm_loadl_epi64(reinterpret_cast<const __m128i*>(W.zero_ptr(j))));
    return _mm512_mul_ps(scales, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(z)));
  }
  return load_pair_ps(reinterpret_cast<const float*>(W.zero_ptr(i)), reinterpret_cast<const float*>(W.zero_ptr(j)));
}

// the 16 output rows of tiles t and t + 1 against MT rows of x (from m0): lanes 0-7 are tile
// t's rows, 8-15 tile t + 1's, so one activation broadcast serves both tiles
template <int MT>
inline void int4_pair_vnni(const Int4Weights& W, int64_t t, const QuantizedRows& X, int64_t m0, float* out,
                           int64_t ldo, llmopt_prefetch::RowStream* side) {
  const int64_t K = W.K, G = W.groups, nb = K / kBlock;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[MT], zacc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = zacc[m] = _mm512_setzero_ps();
  const uint8_t* c0 = W.codes + t * nb * 128;
  const uint8_t* c1 = c0 + nb * 128;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t i = (t * G + g) * kTile, j = i + G * kTile;
    const __m512 vs = scales_pair(W, i, j);
    prefetch_l2(W.scale_ptr(i) + kPrefetchAhead / 8);
    prefetch_l2(W.zero_ptr(i) + kPrefetchAhead / 8);
    for (int64_t b = g * W.group_blocks; b < (g + 1) * W.group_blocks; ++b) {
      // the pair's two tiles are adjacent in memory: the two streams together prefetch each line once
      prefetch_span(c0 + b * 128 + kPrefetchAhead, 128);
      prefetch_span(c1 + b * 128 + kPrefetchAhead, 128);
      if (side != nullptr) side->issue(MT * kSideBytesPerRow);
      __m512i w[8];  // w[j]: columns 4j..4j+3 of the block, 4 bytes per row, 16 rows
      for (int c = 0; c < 4; ++c) {
        const __m512i v = load_pair(c0 + b * 128 + c * 32, c1 + b * 128 + c * 32);
        w[c] = _mm512_and_si512(v, low);
        w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      for (int m = 0; m < MT; ++m) {
        const int32_t* x4 = reinterpret_cast<const int32_t*>(X.q.data() + (m0 + m) * K + b * kBlock);
        // two independent chains (integer sums: the split does not change the result)
        __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(x4[0]));
        __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], _mm512_set1_epi32(x4[1]));
        for (int j = 2; j < 8; j += 2) {
          d0 = _mm512_dpbusd_epi32(d0, w[j], _mm512_set1_epi32(x4[j]));
          d1 = _mm512_dpbusd_epi32(d1, w[j + 1], _mm512_set1_epi32(x4[j + 1]));
        }
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1));
        acc[m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(vs, _mm512_set1_ps(X.d[(m0 + m) * nb + b])), acc[m]);
      }
    }
    const __m512 vz = scaled_zeros_pair(W, i, j, vs);
    for (int m = 0; m < MT; ++m) zacc[m] = _mm512_fmadd_ps(vz, _mm512_set1_ps(X.gsum[(m0 + m) * G + g]), zacc[m]);
  }
  for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + m * ldo, _mm512_sub_ps(acc[m], zacc[m]));
}

// int8 weights: dpbusd on w + 128 (unsigned) against x, less 128 * sum(x) per block: the same integers as
// AVX2's sign trick without its two sign ops per row
template <int MT>
inline void int8_tile_vnni(const Int8Weights& W, int64_t t, const QuantizedRows& X, int64_t m0, float* out,
                           int64_t ldo) {
  const int64_t K = W.K, nb = K / kBlock;
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* wb = W.codes + (t * nb + b) * 256;
    prefetch_span(wb + kPrefetchAhead, 256);
    prefetch_l2(reinterpret_cast<const char*>(W.scales + (t * nb + b) * kTile) + kPrefetchAhead / 8);
    __m256i dot[MT];
    for (int m = 0; m < MT; ++m) dot[m] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      // w + 128 as unsigned bytes: dpbusd's u8 operand with x as its s8 one, one flip shared by all rows
      // instead of two sign ops per row; the 128 * sum(x) it adds is taken off below
      const __m256i wu = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + c * 32)),
                                          _mm256_set1_epi8(static_cast<char>(0x80)));
      for (int m = 0; m < MT; ++m) {
        const int32_t* x4 = reinterpret_cast<const int32_t*>(X.q.data() + (m0 + m) * K + b * kBlock);
        dot[m] = _mm256_dpbusd_epi32(dot[m], wu, _mm256_set1_epi32(x4[c]));
      }
    }
    const __m256 vs = _mm256_loadu_ps(W.scales + (t * nb + b) * kTile);
    for (int m = 0; m < MT; ++m) {
      // the same exact integer dot products as the sign trick's: bitwise the same results
      const __m256i exact = _mm256_sub_epi32(dot[m], _mm256_set1_epi32(128 * X.qsum[(m0 + m) * nb + b]));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_mul_ps(vs, _mm256_set1_ps(X.d[(m0 + m) * nb + b])),
                               acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out + m * ldo, acc[m]);
}

#endif

// ---- AMX-INT8 ----

#if LLMOPT_COMPILED_AMX

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0 and 3 a block's integer results C [16 rows of x, 16 output rows] (s32), 1 and 4
// the activations A [16 rows of x, 32 bytes], 2 and 5 the codes B [8 groups of 4 columns, 16
// output rows x 4 bytes] (tdpbssd: both signed; codes 0..15 fit); two sets, so that two
// blocks' tile products are in flight at once.
inline void amx_configure() {
  TileConfig cfg;
  for (int i : {0, 3}) cfg.rows[i] = kAmxRows, cfg.colsb[i] = 64;
  for (int i : {1, 4}) cfg.rows[i] = kAmxRows, cfg.colsb[i] = kBlock;
  for (int i : {2, 5}) cfg.rows[i] = kBlock / 4, cfg.colsb[i] = 64;
  _tile_loadconfig(&cfg);
}

// Codes of tiles t and t + 1 as tdpbssd's B operand, per block 8 rows x 64 bytes: row j holds
// columns 4j..4j+3 of the 16 output rows, exactly the pair layout the VNNI path builds.
inline void amx_unpack_pair(const Int4Weights& W, int64_t t, int8_t* dst) {
  const int64_t nb = W.K / kBlock;
  const uint8_t* c0 = W.codes + t * nb * 128;
  const uint8_t* c1 = c0 + nb * 128;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b)
    for (int c = 0; c < 4; ++c) {
      const __m512i v = load_pair(c0 + b * 128 + c * 32, c1 + b * 128 + c * 32);
      _mm512_storeu_si512(dst + b * 512 + c * 64, _mm512_and_si512(v, low));
      _mm512_storeu_si512(dst + b * 512 + (c + 4) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    }
}

// Tiles t and t + 1 against rows m0..m0+15 of x (rows of X up to a multiple of 16 exist; only
// those below M are written); b_tiles from amx_unpack_pair, dots a buffer of K / 32 KiB. First
// every block's integer results (tile stores), then the fp32 pass reads them: reading a tile
// store's memory right after it stalls until the store completes, so the two are not interleaved.
inline void int4_pair_amx(const Int4Weights& W, int64_t t, const int8_t* b_tiles, int32_t* dots,
                          const QuantizedRows& X, int64_t m0, int64_t M, float* out, int64_t ldo) {
  const int64_t K = W.K, G = W.groups, nb = K / kBlock;
  const int8_t* a = X.q.data() + m0 * K;
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    _tile_loadd(1, a + b * kBlock, K);
    _tile_loadd(2, b_tiles + b * 512, 64);
    _tile_zero(0);
    _tile_loadd(4, a + (b + 1) * kBlock, K);
    _tile_loadd(5, b_tiles + (b + 1) * 512, 64);
    _tile_zero(3);
    _tile_dpbssd(0, 1, 2);
    _tile_dpbssd(3, 4, 5);
    _tile_stored(0, dots + b * 256, 64);
    _tile_stored(3, dots + (b + 1) * 256, 64);
  }
  if (b < nb) {
    _tile_loadd(1, a + b * kBlock, K);
    _tile_loadd(2, b_tiles + b * 512, 64);
    _tile_zero(0);
    _tile_dpbssd(0, 1, 2);
    _tile_stored(0, dots + b * 256, 64);
  }
  alignas(64) float zacc[kAmxRows * 16] = {};
  __m512 acc[kAmxRows];
  for (int r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t i = (t * G + g) * kTile, j = i + G * kTile;
    const __m512 vs = scales_pair(W, i, j);
    for (b = g * W.group_blocks; b < (g + 1) * W.group_blocks; ++b) {
      const int32_t* c = dots + b * 256;
      const float* xd = X.d.data() + m0 * nb + b;
      for (int r = 0; r < kAmxRows; ++r) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(c + r * 16));
        acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(vs, _mm512_set1_ps(xd[r * nb])), acc[r]);
      }
    }
    const __m512 vz = scaled_zeros_pair(W, i, j, vs);
    for (int r = 0; r < kAmxRows; ++r)
      _mm512_store_ps(zacc + r * 16, _mm512_fmadd_ps(vz, _mm512_set1_ps(X.gsum[(m0 + r) * G + g]),
                                                     _mm512_load_ps(zacc + r * 16)));
  }
  for (int r = 0; r < kAmxRows && m0 + r < M; ++r)
    _mm512_storeu_ps(out + (m0 + r) * ldo, _mm512_sub_ps(acc[r], _mm512_load_ps(zacc + r * 16)));
}

#endif

// ---- dispatch ----

// tile t (8 output rows) against all M rows of x on the scalar or AVX2 path: 4 x-rows at a time
template <typename Weights, void (*Tile4)(const Weights&, int64_t, const QuantizedRows&, int64_t, float*, int64_t),
          void (*Tile1)(const Weights&, int64_t, const QuantizedRows&, int64_t, float*, int64_t)>
inline void rows_of_tile(const Weights& W, int64_t t, const QuantizedRows& X, int64_t M, float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) Tile4(W, t, X, m, out + m * ldo + t * kTile, ldo);
  for (; m < M; ++m) Tile1(W, t, X, m, out + m * ldo + t * kTile, ldo);
}

inline void int4_tile_rows(int isa, const Int4Weights& W, int64_t t, const QuantizedRows& X, int64_t M, float* out,
                           int64_t ldo, llmopt_prefetch::RowStream* side) {
#if defined(__AVX2__) && defined(__FMA__)
  if (isa >= kAvx2) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) int4_tile_avx2<4>(W, t, X, m, out + m * ldo + t * kTile, ldo, side);
    for (; m < M; ++m) int4_tile_avx2<1>(W, t, X, m, out + m * ldo + t * kTile, ldo, side);
    return;
  }
#endif
  rows_of_tile<Int4Weights, int4_tile_scalar<4>, int4_tile_scalar<1>>(W, t, X, M, out, ldo);
}

inline void int8_tile_rows(int isa, const Int8Weights& W, int64_t t, const QuantizedRows& X, int64_t M, float* out,
                           int64_t ldo) {
#if LLMOPT_COMPILED_AVX512
  if (isa >= kAvx512 && M >= kInt8VnniMinRows)
    return rows_of_tile<Int8Weights, int8_tile_vnni<4>, int8_tile_vnni<1>>(W, t, X, M, out, ldo);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (isa >= kAvx2) return rows_of_tile<Int8Weights, int8_tile_avx2<4>, int8_tile_avx2<1>>(W, t, X, M, out, ldo);
#endif
  rows_of_tile<Int8Weights, int8_tile_scalar<4>, int8_tile_scalar<1>>(W, t, X, M, out, ldo);
}

// Tiles [t0, t1) against all M rows of x. The wide paths take tiles in pairs (from t0, which is
// even); an odd last tile goes through AVX2, whose results are bitwise the same. `side`, where given,
// asks for kSideBytesPerRow bytes of its rows per block of K per row of x.
void int4_tiles(int isa, const Int4Weights& W, int64_t t0, int64_t t1, const QuantizedRows& X, int64_t M, float* out,
                int64_t ldo, llmopt_prefetch::RowStream* side = nullptr) {
  const int64_t tile_bytes = W.K / kBlock * 128, tile_entries = W.groups * kTile;
  prefetch_span(W.codes + t0 * tile_bytes, std::min(kPrefetchAhead, (t1 - t0) * tile_bytes));
  prefetch_span(W.scale_ptr(t0 * tile_entries), std::min(kPrefetchAhead / 8, (t1 - t0) * tile_entries * W.scale_bytes()));
  prefetch_span(W.zero_ptr(t0 * tile_entries), std::min(kPrefetchAhead / 8, (t1 - t0) * tile_entries * W.zero_bytes()));
  int64_t t = t0;
#if LLMOPT_COMPILED_AMX
  if (isa >= kAmx && M >= kAmxMinRows && t + 2 <= t1) {
    const int64_t nb = W.K / kBlock;
    std::vector<int8_t> b_tiles(nb * 512);
    std::vector<int32_t> dots(nb * 256 + 16);  // + 16: room to align to 64 bytes
    int32_t* d = dots.data() + (16 - reinterpret_cast<uintptr_t>(dots.data()) / 4 % 16) % 16;
    amx_configure();
    for (; t + 2 <= t1; t += 2) {
      amx_unpack_pair(W, t, b_tiles.data());
      for (int64_t m = 0; m < M; m += kAmxRows) int4_pair_amx(W, t, b_tiles.data(), d, X, m, M, out + t * kTile, ldo);
      if (side != nullptr) side->issue(kAmxRows * nb * kSideBytesPerRow);
    }
    _tile_release();
  }
#endif
#if LLMOPT_COMPILED_AVX512
  if (isa >= kAvx512) {
    // rows of x in runs of kRowRun, each against all of the span's tiles: a run's int8 rows stay in L2
    // while the tiles stream past, instead of every row of x read again from L3 for each pair of tiles
    const int64_t pairs_end = t + (t1 - t) / 2 * 2;
    for (int64_t m0 = 0; m0 < M; m0 += kRowRun) {
      const int64_t m1 = std::min(M, m0 + kRowRun);
      for (int64_t tp = t; tp < pairs_end; tp += 2) {
        int64_t m = m0;
        for (; m + 8 <= m1; m += 8) int4_pair_vnni<8>(W, tp, X, m, out + m * ldo + tp * kTile, ldo, side);
        for (; m + 4 <= m1; m += 4) int4_pair_vnni<4>(W, tp, X, m, out + m * ldo + tp * kTile, ldo, side);
        for (; m < m1; ++m) int4_pair_vnni<1>(W, tp, X, m, out + m * ldo + tp * kTile, ldo, side);
      }
    }
    t = pairs_end;
  }
#endif
  for (; t < t1; ++t) int4_tile_rows(isa, W, t, X, M, out, ldo, side);
}

}  // namespace

bool int4_linear_simd() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

static void check_int4(int64_t K, const torch::Tensor& codes, const torch::Tensor& scales, const torch::Tensor& zeros,
                       int64_t out_features, int64_t group_size, const c10::optional<torch::Tensor>& perm) {
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.dim() == 2 && codes.is_contiguous() && codes.size(1) * 2 == K * kTile,
              "int4_linear: codes uint8 [N / 8, K * 4] contiguous");
  const int64_t tiles = codes.size(0), N = out_features;
  TORCH_CHECK(K % kBlock == 0, "int4_linear: K must be a multiple of 32");
  TORCH_CHECK(N > (tiles - 1) * kTile && N <= tiles * kTile, "int4_linear: out_features does not match the codes");
  TORCH_CHECK(group_size % kBlock == 0 && K % group_size == 0, "int4_linear: group size must be a multiple of 32 dividing K");
  const int64_t groups = K / group_size;
  const bool compact = scales.dtype() == torch::kFloat16;
  TORCH_CHECK((compact && zeros.dtype() == torch::kUInt8) ||
                  (scales.dtype() == torch::kFloat32 && zeros.dtype() == torch::kFloat32),
              "int4_linear: scales fp16 with zeros uint8, or scales fp32 with scale * zero fp32");
  TORCH_CHECK(scales.is_contiguous() && zeros.is_contiguous() && scales.numel() == tiles * kTile * groups &&
                  zeros.numel() == tiles * kTile * groups,
              "int4_linear: scales and zeros [N / 8, K / group_size, 8] contiguous");
  if (perm.has_value())
    TORCH_CHECK(perm->dtype() == torch::kInt64 && perm->numel() == K && perm->is_contiguous(), "int4_linear: perm int64 [K]");
}

static Int4Weights int4_weights(const torch::Tensor& codes, const torch::Tensor& scales, const torch::Tensor& zeros,
                                int64_t group_size) {
  const int64_t K = codes.size(1) * 2 / kTile;
  return Int4Weights{codes.data_ptr<uint8_t>(), scales.data_ptr(), zeros.data_ptr(), K, K / group_size,
                     group_size / kBlock, scales.dtype() == torch::kFloat16};
}

// x [M, K] quantized for the weights' groups (padded to whole AMX tiles where that path runs)
static QuantizedRows quantize_for(int isa, const float* x, int64_t M, const Int4Weights& W,
                                  const c10::optional<torch::Tensor>& perm) {
  const bool amx = isa >= kAmx && M >= kAmxMinRows;
  const int64_t rows = amx ? (M + kAmxRows - 1) / kAmxRows * kAmxRows : M;
  return quantize_rows(x, M, W.K, W.group_blocks, perm.has_value() ? perm->data_ptr<int64_t>() : nullptr, rows, isa);
}

void int4_linear_check(const torch::Tensor& codes, const torch::Tensor& scales, const torch::Tensor& zeros,
                       int64_t out_features, int64_t group_size, const c10::optional<torch::Tensor>& perm,
                       const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(codes.dim() == 2, "int4_linear: codes uint8 [N / 8, K * 4] contiguous");
  check_int4(codes.size(1) * 2 / kTile, codes, scales, zeros, out_features, group_size, perm);
  if (bias.has_value())
    TORCH_CHECK(bias->dtype() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == out_features,
                "int4_linear: bias fp32 [out_features]");
}

std::vector<WeightRegion> int4_weight_regions(const torch::Tensor& codes, const torch::Tensor& scales,
                                              const torch::Tensor& zeros);

constexpr int64_t kNextPrefetch = 16384;  // bytes of each region of `next`, from the start of the share

// The decode plan's team (csrc/team.h): share `share` of `shares` of y = x @ dequant(W).T + bias into
// out [M, ldo] (ldo: the padded width, codes.size(0) * 8), in pairs of tiles as int4_linear splits them;
// x [M, K] fp32 contiguous, quantized by the calling thread. Then the thread prefetches its share of
// `next` (the weights of the projection after this one): after a projection come microseconds of small
// ops (norms, rope, attention) while the memory system would sit idle, and the same thread takes the
// same fraction of the next projection's tiles. Arguments as int4_linear_check passed them.
void int4_linear_share(const float* x, int64_t M, const torch::Tensor& codes, const torch::Tensor& scales,
                       const torch::Tensor& zeros, int64_t out_features, int64_t group_size,
                       const c10::optional<torch::Tensor>& perm, const c10::optional<torch::Tensor>& bias, float* out,
                       int64_t ldo, int64_t share, int64_t shares, const std::vector<WeightRegion>& next,
                       llmopt_prefetch::RowStream* side) {
  const int64_t tiles = codes.size(0), pairs = (tiles + 1) / 2;
  const llmopt_team::Range r = llmopt_team::split(pairs, 2, share, shares);
  if (M > 0 && r.begin < r.end) {
    const int isa = llmopt_isa::active_isa();
    const Int4Weights W = int4_weights(codes, scales, zeros, group_size);
    const QuantizedRows X = quantize_for(isa, x, M, W, perm);
    const int64_t t0 = 2 * r.begin, t1 = std::min(2 * r.end, tiles);
    int4_tiles(isa, W, t0, t1, X, M, out, ldo, side);
    if (bias.has_value()) {
      const float* b = bias->data_ptr<float>();
      const int64_t c1 = std::min(t1 * kTile, out_features);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t c = t0 * kTile; c < c1; ++c) out[m * ldo + c] += b[c];
    }
  }
  for (const WeightRegion& region : next) {
    const int64_t from = region.bytes * r.begin / pairs, to = region.bytes * r.end / pairs;
    llmopt_prefetch::prefetch_span(region.data + from, std::min(to - from, region.max_bytes));
  }
}

std::vector<WeightRegion> int4_weight_regions(const torch::Tensor& codes, const torch::Tensor& scales,
                                              const torch::Tensor& zeros) {
  const auto region = [](const torch::Tensor& t, int64_t max_bytes) {
    return WeightRegion{static_cast<const char*>(t.data_ptr()), t.numel() * static_cast<int64_t>(t.element_size()),
                        max_bytes};
  };
  return {region(codes, kNextPrefetch), region(scales, kNextPrefetch / 8), region(zeros, kNextPrefetch / 8)};
}

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor zeros,
                          int64_t out_features, int64_t group_size, c10::optional<torch::Tensor> perm,
                          c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "int4_linear: x fp32 [M, K] contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  check_int4(K, codes, scales, zeros, out_features, group_size, perm);
  const int64_t tiles = codes.size(0), N = out_features;
  // an output width that is not a multiple of 8 computes the padded rows and drops them
  auto padded = torch::empty({M, tiles * kTile}, x.options());
  if (M > 0) {
    const int isa = llmopt_isa::active_isa();
    const Int4Weights W = int4_weights(codes, scales, zeros, group_size);
    const QuantizedRows X = quantize_for(isa, x.data_ptr<float>(), M, W, perm);
    float* op = padded.data_ptr<float>();
    const int64_t ldo = tiles * kTile;
    // work in pairs of tiles (the wide paths' unit)
    const int64_t pairs = (tiles + 1) / 2;
    at::parallel_for(0, pairs, 2, [&](int64_t begin, int64_t end) {
      int4_tiles(isa, W, 2 * begin, std::min(2 * end, tiles), X, M, op, ldo);
    });
  }
  auto out = N == tiles * kTile ? padded : padded.narrow(1, 0, N).contiguous();
  if (bias.has_value()) out.add_(bias.value());
  return out;
}

// y = x @ (codes * scale).T: symmetric 8-bit weights, one scale per row and 32 columns (Q8_0);
// the same int8 activations and the same tile order as int4_linear.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t out_features) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "int8_linear: x fp32 [M, K] contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kBlock == 0, "int8_linear: K must be a multiple of 32");
  TORCH_CHECK(codes.dtype() == torch::kInt8 && codes.dim() == 2 && codes.is_contiguous() && codes.size(1) == K * kTile,
              "int8_linear: codes int8 [N / 8, K * 8] contiguous");
  const int64_t tiles = codes.size(0), N = out_features;
  TORCH_CHECK(N > (tiles - 1) * kTile && N <= tiles * kTile, "int8_linear: out_features does not match the codes");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == tiles * (K / kBlock) * kTile,
              "int8_linear: scales fp32 [N / 8, K / 32, 8]");
  auto padded = torch::empty({M, tiles * kTile}, x.options());
  if (M > 0) {
    const int isa = llmopt_isa::active_isa();
    const QuantizedRows X = quantize_rows(x.data_ptr<float>(), M, K, 1, nullptr, M, isa);
    const Int8Weights W{codes.data_ptr<int8_t>(), scales.data_ptr<float>(), K};
    float* op = padded.data_ptr<float>();
    const int64_t ldo = tiles * kTile;
    at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
      const int64_t tile_bytes = K * kTile;
      prefetch_span(W.codes + begin * tile_bytes, std::min(kPrefetchAhead, (end - begin) * tile_bytes));
      for (int64_t t = begin; t < end; ++t) int8_tile_rows(isa, W, t, X, M, op, ldo);
    });
  }
  return N == tiles * kTile ? padded : padded.narrow(1, 0, N).contiguous();
}
