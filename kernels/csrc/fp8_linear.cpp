// y = x @ (codes * scale).T (+ bias) for fp32 x and FP8 e4m3 weights with a float32 scale per
// output row (compressed-tensors' float-quantized checkpoints), on CPU.
//
// A decode step reads every weight once; e4m3 codes are a quarter of fp32's bytes. Each code is
// widened in registers, never written back as a float: its 7 exponent+mantissa bits shifted
// into an fp16's bits 13..7 (and the sign to bit 15) make an fp16 worth exactly code / 256 (an
// e4m3 subnormal m * 2^-9 lands on fp16's subnormal m * 2^-17), which F16C's vcvtph2ps turns
// into 8 floats (AVX2) or AVX-512's into 16. The row's sum is multiplied by 256 (exact) and the
// scale at the end. Without F16C (or capped to "scalar") a 256-entry table of code / 256 does
// the widening.
//
// Every output element is the same arithmetic whatever the tile it falls in and whatever the
// number of rows: lane-wise partial sums over k in order, one fixed horizontal sum, then the k
// tail. So a sequence's result does not depend on what else is in the batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <array>
#include <cmath>
#include <cstdint>

#include "isa.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LLMOPT_FP8_AVX2 1
#endif

namespace {

// code / 256 for every e4m3 byte (S.EEEE.MMM, bias 7; 0x7F / 0xFF are NaN in e4m3fn and are
// never written by a quantizer that clamps to +-448: read here as the bit pattern's 480 / 256)
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

// scalar: out[m][j] for MT rows of x and one weight row, k in order
void scalar_rows(const float* x, int64_t M, const uint8_t* w, int64_t K, const float* scale, float* out,
                 int64_t N, int64_t n) {
  const auto& t = fp8_table();
  for (int64_t m = 0; m < M; ++m) {
    float s = 0.0f;
    for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * t[w[k]];
    out[m * N + n] = s * 256.0f * scale[n];
  }
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
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
  return _mm256_cvtph_ps(h);
}

// out[m][j] = dot(x[m], w[j]) * 256 * scale[j] for MT rows of x and NT weight rows
template <int NT, int MT>
inline void dot_tile(const float* x, const uint8_t* w, int64_t K, const float* scale, float* out, int64_t ldo) {
  const auto& t = fp8_table();
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
    for (int j = 0; j < NT; ++j) {
      float s = hsum8(acc[m][j]);
      for (int64_t r = k; r < K; ++r) s += x[m * K + r] * t[w[j * K + r]];
      out[m * ldo + j] = s * 256.0f * scale[j];
    }
}

template <int NT>
inline void weight_rows(const float* x, int64_t M, const uint8_t* w, int64_t K, const float* scale, float* out,
                        int64_t N) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) dot_tile<NT, 2>(x + m * K, w, K, scale, out + m * N, N);
  for (; m < M; ++m) dot_tile<NT, 1>(x + m * K, w, K, scale, out + m * N, N);
}

template <int NT>
void simd_all_rows(const float* x, int64_t M, const uint8_t* w, int64_t K, const float* scale, float* out,
                   int64_t N) {
  const int64_t blocks = N / NT;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) weight_rows<NT>(x, M, w + b * NT * K, K, scale + b * NT, out + b * NT, N);
  });
  for (int64_t n = blocks * NT; n < N; ++n) weight_rows<1>(x, M, w + n * K, K, scale + n, out + n, N);
}
#endif

}  // namespace

bool fp8_linear_simd() {
#ifdef LLMOPT_FP8_AVX2
  return llmopt_isa::active_isa() >= llmopt_isa::kAvx2;
#else
  return false;
#endif
}

torch::Tensor fp8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && codes.dtype() == torch::kUInt8 && scales.dtype() == torch::kFloat32,
              "fp8_linear: fp32 x, e4m3 codes as uint8, fp32 scales");
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && x.size(1) == codes.size(1) && scales.numel() == codes.size(0),
              "fp8_linear: x [M, K], codes [N, K], scales [N]");
  TORCH_CHECK(x.is_contiguous() && codes.is_contiguous() && scales.is_contiguous(), "fp8_linear: contiguous inputs");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
#ifdef LLMOPT_FP8_AVX2
  if (fp8_linear_simd()) {
    if (M == 1)
      simd_all_rows<8>(xp, M, wp, K, sp, op, N);
    else
      simd_all_rows<6>(xp, M, wp, K, sp, op, N);
    if (bias.has_value()) out.add_(bias.value());
    return out;
  }
#endif
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) scalar_rows(xp, M, wp + n * K, K, sp, op, N, n);
  });
  if (bias.has_value()) out.add_(bias.value());
  return out;
}
