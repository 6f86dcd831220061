// y = x @ (codes * scale).T (+ bias) for fp32 x and FP8 e4m3 weights with a float32 scale per
// output row (compressed-tensors' float-quantized checkpoints), on CPU.
//
// A decode step reads every weight once; e4m3 codes are a quarter of fp32's bytes. Each code is
// widened in registers, never written back as a float, in three integer operations and one
// conversion: sign-extend the byte to 16 bits, shift left by 7 and clear bit 14. That puts the
// sign in bit 15 and the 7 exponent+mantissa bits in bits 13..7: an fp16 worth exactly
// code / 256 (fp16's exponent bias 15 is e4m3's 7 plus 8, and an e4m3 subnormal m * 2^-9 lands
// on fp16's subnormal m * 2^-17, which the conversion widens exactly). F16C's vcvtph2ps turns 8
// of them into floats (AVX2), AVX-512's 16. Every widened value is a normal float (or zero), so
// no FMA meets a subnormal operand. The row's sum is multiplied by 256 (exact) and the scale at
// the end. The NaN codes 0x7F / 0xFF (never written by a quantizer that clamps to +-448) widen
// to the fp16 bit pattern's 480 / 256 on every path. Without F16C (or capped to "scalar") a
// 256-entry table of code / 256 does the widening.
//
// Paths, chosen at run time (csrc/isa.h; "amx" takes the AVX-512 one):
// - avx512: 32 codes per step (one 512-bit sign-extend, shift and mask, two 16-float
//   conversions), 16-lane accumulators; one x row streams 8 weight rows, batches run tiles of 4
//   x rows by 6 weight rows, so each weight read and widened serves 4 rows of x.
// - avx2: 8 codes per conversion, 8-lane accumulators; 8 weight rows for one x row, 2 x 6 tiles.
// - scalar: the table.
// Every output element is the same arithmetic whatever the tile it falls in and whatever the
// number of rows: lane-wise partial sums over k in order, one fixed horizontal sum, then the k
// tail. So a sequence's result does not depend on what else is in the batch. The paths group
// their sums differently (16 lanes, 8 lanes, one), so they agree within float rounding.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <array>
#include <cmath>
#include <cstdint>

#include "isa.h"
#include "team.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LLMOPT_FP8_AVX2 1
#if LLMOPT_COMPILED_AVX512
#define LLMOPT_FP8_AVX512 1
#endif
#endif

namespace {

// Weight rows per parallel task unit: at::parallel_for's grain, in blocks of NT rows.
constexpr int64_t kGrainBlocks = 16;

// code / 256 for every e4m3 byte (S.EEEE.MMM, bias 7), bit for bit what the SIMD widening gives
// (the NaN patterns 0x7F / 0xFF included: their bits read as an fp16, 480 / 256)
const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 0xF, m = b & 7;
      const float v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
      t[b] = ((b & 0x80) ? -v : v) / 256.0f;
    }
    return t;
  }();
  return table;
}

// the k tail of one output element, after the SIMD steps: s += x[r] * w[r] for r in [k, K).
// An explicit fma: with `s += x * t` the compiler fuses or not depending on where it inlines the
// tail (1-row vs 2-row tiles came out different on a Zen 4 build), which broke batch invariance.
inline float tail(float s, const float* x, const uint8_t* w, int64_t k, int64_t K) {
  const auto& t = fp8_table();
  for (; k < K; ++k) s = std::fma(x[k], t[w[k]], s);
  return s;
}

// scalar: out[m][n] for every row of x and one weight row, k in order
void scalar_rows(const float* x, int64_t M, const uint8_t* w, int64_t K, const float* scale, float* out,
                 int64_t N, int64_t n) {
  for (int64_t m = 0; m < M; ++m) out[m * N + n] = tail(0.0f, x + m * K, w, 0, K) * 256.0f * scale[n];
}

// Weight-row blocks [b0, b1) of NT rows (`block(n)` computes the block from row n against every row
// of x) and, with `tail`, the last N % NT rows one by one (`single(n)`).
template <int NT, typename Block, typename Single>
void weight_blocks(int64_t N, int64_t b0, int64_t b1, bool tail, const Block& block, const Single& single) {
  for (int64_t b = b0; b < b1; ++b) block(b * NT);
  if (tail)
    for (int64_t n = N / NT * NT; n < N; ++n) single(n);
}

#ifdef LLMOPT_FP8_AVX2
inline float hsum8(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// 8 codes as floats worth code / 256 (see the header)
inline __m256 widen8(const uint8_t* w) {
  const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)));
  return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(static_cast<short>(0xBFFF))));
}

// out[m][j] = dot(x[m], w[j]) * 256 * scale[j] for MT rows of x and NT weight rows
template <int NT, int MT>
inline void dot_tile8(const float* x, const uint8_t* w, int64_t K, const float* scale, float* out, int64_t ldo) {
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 a[MT];
    for (int m = 0; m < MT; ++m) a[m] = _mm256_loadu_ps(x + m * K + k);
    for (int j = 0; j < NT; ++j) {
      const __m256 b = widen8(w + j * K + k);
      for (int m = 0; m < MT; ++m) acc[m][j] = _mm256_fmadd_ps(a[m], b, acc[m][j]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j)
      out[m * ldo + j] = tail(hsum8(acc[m][j]), x + m * K, w + j * K, k, K) * 256.0f * scale[j];
}

// NT weight rows against all M rows of x, two x rows at a time
template <int NT>
inline void rows8(const float* x, int64_t M, const uint8_t* w, int64_t K, const float* scale, float* out, int64_t N) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) dot_tile8<NT, 2>(x + m * K, w, K, scale, out + m * N, N);
  for (; m < M; ++m) dot_tile8<NT, 1>(x + m * K, w, K, scale, out + m * N, N);
}

// 6 weight rows x 2 x rows: 12 accumulators, as many as AVX2's 16 registers allow with the
// operands; one x row (batch 1) streams 8 weight rows at a time.
template <int NT>
void avx2_blocks(const float* x, int64_t M, const uint8_t* w, int64_t K, const float* scale, float* out, int64_t ldo,
                 int64_t N, int64_t b0, int64_t b1, bool tail) {
  weight_blocks<NT>(
      N, b0, b1, tail, [&](int64_t n) { rows8<NT>(x, M, w + n * K, K, scale + n, out + n, ldo); },
      [&](int64_t n) { rows8<1>(x, M, w + n * K, K, scale + n, out + n, ldo); });
}
#endif

#ifdef LLMOPT_FP8_AVX512
// 32 codes as two vectors of 16 floats worth code / 256 (k .. k+15 and k+16 .. k+31)
inline void widen32(const uint8_t* w, __m512& lo, __m512& hi) {
  const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  const __m512i h = _mm512_and_si512(_mm512_slli_epi16(b, 7), _mm512_set1_epi16(static_cast<short>(0xBFFF)));
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

// 16 codes as 16 floats worth code / 256
inline __m512 widen16(const uint8_t* w) {
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF))));
}

// dot_tile8 on 16 lanes: per lane the products k, k+16 of each 32-code step in order, then one
// 16-code step, one fixed reduction, the k tail
template <int NT, int MT>
inline void dot_tile16(const float* x, const uint8_t* w, int64_t K, const float* scale, float* out, int64_t ldo) {
  __m512 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    for (int j = 0; j < NT; ++j) {
      __m512 lo, hi;
      widen32(w + j * K + k, lo, hi);
      for (int m = 0; m < MT; ++m) acc[m][j] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k), lo, acc[m][j]);
      for (int m = 0; m < MT; ++m) acc[m][j] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k + 16), hi, acc[m][j]);
    }
  }
  if (k + 16 <= K) {
    for (int j = 0; j < NT; ++j) {
      const __m512 b = widen16(w + j * K + k);
      for (int m = 0; m < MT; ++m) acc[m][j] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k), b, acc[m][j]);
    }
    k += 16;
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j)
      out[m * ldo + j] = tail(_mm512_reduce_add_ps(acc[m][j]), x + m * K, w + j * K, k, K) * 256.0f * scale[j];
}

template <int NT>
inline void rows16(const float* x, int64_t M, const uint8_t* w, int64_t K, const float* scale, float* out,
                   int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) dot_tile16<NT, 4>(x + m * K, w, K, scale, out + m * N, N);
  for (; m + 2 <= M; m += 2) dot_tile16<NT, 2>(x + m * K, w, K, scale, out + m * N, N);
  for (; m < M; ++m) dot_tile16<NT, 1>(x + m * K, w, K, scale, out + m * N, N);
}

// 4 x rows by 6 weight rows: 24 of the 32 registers accumulate; batch 1 streams 8 weight rows
template <int NT>
void avx512_blocks(const float* x, int64_t M, const uint8_t* w, int64_t K, const float* scale, float* out, int64_t ldo,
                   int64_t N, int64_t b0, int64_t b1, bool tail) {
  weight_blocks<NT>(
      N, b0, b1, tail, [&](int64_t n) { rows16<NT>(x, M, w + n * K, K, scale + n, out + n, ldo); },
      [&](int64_t n) { rows16<1>(x, M, w + n * K, K, scale + n, out + n, ldo); });
}
#endif

// The path fp8_linear takes now: the widest this build compiled, the CPU has and the cap allows.
int fp8_path() {
  const int isa = llmopt_isa::active_isa();
#ifdef LLMOPT_FP8_AVX512
  if (isa >= llmopt_isa::kAvx512) return llmopt_isa::kAvx512;
#endif
#ifdef LLMOPT_FP8_AVX2
  if (isa >= llmopt_isa::kAvx2) return llmopt_isa::kAvx2;
#endif
  (void)isa;
  return llmopt_isa::kScalar;
}

// Weight rows per block: 8 for one row of x (a batch-1 step streams them), 6 for tiles of several
// rows (AVX-512: 4 x rows by 6, AVX2: 2 by 6), 1 on the scalar path
int64_t rows_per_block(int path, int64_t M) { return path == llmopt_isa::kScalar ? 1 : (M == 1 ? 8 : 6); }

// blocks [b0, b1) of rows_per_block(path, M) weight rows against every row of x into out (rows ldo
// apart); with `tail` the last N % rows_per_block rows
void fp8_part(int path, const float* xp, int64_t M, const uint8_t* wp, int64_t K, const float* sp, float* op,
              int64_t ldo, int64_t N, int64_t b0, int64_t b1, bool tail) {
  switch (path) {
#ifdef LLMOPT_FP8_AVX512
    case llmopt_isa::kAvx512:
      if (M == 1)
        avx512_blocks<8>(xp, M, wp, K, sp, op, ldo, N, b0, b1, tail);
      else
        avx512_blocks<6>(xp, M, wp, K, sp, op, ldo, N, b0, b1, tail);
      return;
#endif
#ifdef LLMOPT_FP8_AVX2
    case llmopt_isa::kAvx2:
      if (M == 1)
        avx2_blocks<8>(xp, M, wp, K, sp, op, ldo, N, b0, b1, tail);
      else
        avx2_blocks<6>(xp, M, wp, K, sp, op, ldo, N, b0, b1, tail);
      return;
#endif
    default:
      for (int64_t n = b0; n < b1; ++n) scalar_rows(xp, M, wp + n * K, K, sp, op, ldo, n);
  }
}

}  // namespace

// The decode plan's team (csrc/team.h): share `share` of `shares` of y = x @ (codes * scale).T + bias into
// out [M, ldo], the blocks split as fp8_linear splits them; the first share also takes the last rows.
// x [M, K] fp32 contiguous; the weights as fp8_linear_check passed them.
void fp8_linear_share(const float* x, int64_t M, const torch::Tensor& codes, const torch::Tensor& scales,
                      const c10::optional<torch::Tensor>& bias, float* out, int64_t ldo, int64_t share, int64_t shares) {
  const int64_t N = codes.size(0), K = codes.size(1);
  const int path = fp8_path();
  const int64_t nt = rows_per_block(path, M);
  const llmopt_team::Range r = llmopt_team::split(N / nt, kGrainBlocks, share, shares);
  const bool tail = share == 0;
  fp8_part(path, x, M, codes.data_ptr<uint8_t>(), K, scales.data_ptr<float>(), out, ldo, N, r.begin, r.end, tail);
  if (bias.has_value()) {
    const float* b = bias->data_ptr<float>();
    const auto add = [&](int64_t c0, int64_t c1) {
      for (int64_t m = 0; m < M; ++m)
        for (int64_t c = c0; c < c1; ++c) out[m * ldo + c] += b[c];
    };
    add(r.begin * nt, r.end * nt);
    if (tail) add(N / nt * nt, N);
  }
}

void fp8_linear_check(const torch::Tensor& codes, const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == torch::kUInt8 &&
                  scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 && scales.numel() == codes.size(0),
              "fp8_linear: contiguous e4m3 codes [N, K] as uint8 and fp32 scales [N]");
  if (bias.has_value())
    TORCH_CHECK(bias->dtype() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == codes.size(0),
                "fp8_linear: bias fp32 [N]");
}

std::string fp8_linear_path() { return llmopt_isa::isa_name(fp8_path()); }

bool fp8_linear_simd() { return fp8_path() != llmopt_isa::kScalar; }

torch::Tensor fp8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && codes.dtype() == torch::kUInt8 && scales.dtype() == torch::kFloat32,
              "fp8_linear: fp32 x, e4m3 codes as uint8, fp32 scales");
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && x.size(1) == codes.size(1) && scales.numel() == codes.size(0),
              "fp8_linear: x [M, K], codes [N, K], scales [N]");
  TORCH_CHECK(x.is_contiguous() && codes.is_contiguous() && scales.is_contiguous(), "fp8_linear: contiguous inputs");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  auto out = torch::empty({M, N}, x.options());
  const int path = fp8_path();
  const int64_t nt = rows_per_block(path, M);
  at::parallel_for(0, N / nt, kGrainBlocks, [&](int64_t begin, int64_t end) {
    fp8_part(path, x.data_ptr<float>(), M, codes.data_ptr<uint8_t>(), K, scales.data_ptr<float>(), out.data_ptr<float>(),
             N, N, begin, end, false);
  });
  fp8_part(path, x.data_ptr<float>(), M, codes.data_ptr<uint8_t>(), K, scales.data_ptr<float>(), out.data_ptr<float>(), N,
           N, 0, 0, true);
  if (bias.has_value()) out.add_(bias.value());
  return out;
}
