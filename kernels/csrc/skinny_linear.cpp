// y = x @ w.T (+ bias) for fp32 on CPU when x has few rows (decode steps): "skinny" GEMM.
//
// MKL's GEMM packs (copies) the weight on every call; with a handful of rows that copy costs
// more than the arithmetic, so a batch-4 decode step took twice as long as batch 1. Here each
// weight row is read once, straight from the [out, in] row-major weight, and used against every
// row of x while it sits in L1: dot products, 8 floats per AVX2 lane group, with the x rows
// in L2. Batch 1 runs at memory bandwidth; batch 32 1.3-1.6x MKL's rate (`llmopt bench kernels --device cpu`).
//
// Every output element is the same arithmetic whatever the tile it falls in and whatever the
// number of rows: 8 lane-wise partial sums over k in order, one fixed horizontal sum, then the
// k tail. So a sequence's logits do not depend on what else is in the batch.
//
// With AVX-512 (`llmopt_isa::active_isa()`, chosen at run time) the same scheme runs on 16-float
// lanes with 32 registers: 4 x rows by 6 weight rows per tile, half the instructions per product.
// Its sums are grouped in 16 lanes, so its results differ from the AVX2 path's by float rounding;
// within one path they still do not depend on the other rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "isa.h"
#include "team.h"

#if defined(__AVX2__) && defined(__FMA__)
#include "vec_math.h"

// 8 weights as floats: vec_math.h's load8 (fp32 as they are; bf16 widened)
static inline float to_float(float v) { return v; }
static inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

// out[m][j] = dot(x[m], w[j]) for MT rows of x and NT rows of w, both with row stride K
template <int NT, int MT, typename W>
static inline void dot_tile(const float* x, const W* w, int64_t K, float* out, int64_t ldo) {
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 a[MT];
    for (int m = 0; m < MT; ++m) a[m] = _mm256_loadu_ps(x + m * K + k);
    for (int j = 0; j < NT; ++j) {
      const __m256 b = load8(w + j * K + k);
      for (int m = 0; m < MT; ++m) acc[m][j] = _mm256_fmadd_ps(a[m], b, acc[m][j]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) {
      float s = hsum8(acc[m][j]);
      for (int64_t t = k; t < K; ++t) s += x[m * K + t] * to_float(w[j * K + t]);
      out[m * ldo + j] = s;
    }
}

// one block of NT weight rows against all M rows of x (x rows two at a time)
template <int NT, typename W>
static inline void weight_rows(const float* x, int64_t M, const W* w, int64_t K, float* out, int64_t N) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) dot_tile<NT, 2>(x + m * K, w, K, out + m * N, N);
  for (; m < M; ++m) dot_tile<NT, 1>(x + m * K, w, K, out + m * N, N);
}

// weight-row blocks [b0, b1) of NT rows, and with `tail` the last N % NT rows one by one (out rows ldo apart)
template <int NT, typename W>
static void block_rows(const float* x, int64_t M, const W* w, int64_t K, float* out, int64_t ldo, int64_t N,
                       int64_t b0, int64_t b1, bool tail) {
  for (int64_t b = b0; b < b1; ++b) weight_rows<NT, W>(x, M, w + b * NT * K, K, out + b * NT, ldo);
  if (tail)
    for (int64_t n = N / NT * NT; n < N; ++n) weight_rows<1, W>(x, M, w + n * K, K, out + n, ldo);
}

#if defined(__AVX512F__)
// 16 weights as floats (bf16 widened as in load8)
static inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
static inline __m512 load16(const at::BFloat16* w) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// dot_tile on 16 lanes: 16 lane-wise partial sums over k in order, one fixed reduction, the k tail
template <int NT, int MT, typename W>
static inline void dot_tile16(const float* x, const W* w, int64_t K, float* out, int64_t ldo) {
  __m512 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 a[MT];
    for (int m = 0; m < MT; ++m) a[m] = _mm512_loadu_ps(x + m * K + k);
    for (int j = 0; j < NT; ++j) {
      const __m512 b = load16(w + j * K + k);
      for (int m = 0; m < MT; ++m) acc[m][j] = _mm512_fmadd_ps(a[m], b, acc[m][j]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < NT; ++j) {
      float s = _mm512_reduce_add_ps(acc[m][j]);
      for (int64_t t = k; t < K; ++t) s += x[m * K + t] * to_float(w[j * K + t]);
      out[m * ldo + j] = s;
    }
}

template <int NT, typename W>
static inline void weight_rows16(const float* x, int64_t M, const W* w, int64_t K, float* out, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) dot_tile16<NT, 4>(x + m * K, w, K, out + m * N, N);
  for (; m + 2 <= M; m += 2) dot_tile16<NT, 2>(x + m * K, w, K, out + m * N, N);
  for (; m < M; ++m) dot_tile16<NT, 1>(x + m * K, w, K, out + m * N, N);
}

template <int NT, typename W>
static void block_rows16(const float* x, int64_t M, const W* w, int64_t K, float* out, int64_t ldo, int64_t N,
                         int64_t b0, int64_t b1, bool tail) {
  for (int64_t b = b0; b < b1; ++b) weight_rows16<NT, W>(x, M, w + b * NT * K, K, out + b * NT, ldo);
  if (tail)
    for (int64_t n = N / NT * NT; n < N; ++n) weight_rows16<1, W>(x, M, w + n * K, K, out + n, ldo);
}
static constexpr bool kHaveAvx512 = true;
#else
template <int NT, typename W>
static void block_rows16(const float*, int64_t, const W*, int64_t, float*, int64_t, int64_t, int64_t, int64_t, bool) {}
static constexpr bool kHaveAvx512 = false;
#endif

bool skinny_linear_available() { return true; }

// Weight rows per block for M rows of x: with AVX-512 (`llmopt_isa::active_isa()`) 4 x rows by 6 weight
// rows, 24 of the 32 registers accumulating; with AVX2 6 weight rows x 2 x rows, 12 accumulators, as many
// as its 16 registers allow with the operands. One x row (batch 1) is memory-bound: 8 weight rows at a
// time streams best on both.
struct Blocking {
  bool wide;
  int nt;
};

static Blocking blocking(int64_t M) {
  return {kHaveAvx512 && llmopt_isa::active_isa() >= llmopt_isa::kAvx512, M == 1 ? 8 : 6};
}

template <typename W>
static void skinny_part(Blocking bk, const float* xp, int64_t M, const W* wp, int64_t K, float* op, int64_t ldo,
                        int64_t N, int64_t b0, int64_t b1, bool tail) {
  if (bk.wide) {
    if (bk.nt == 8)
      block_rows16<8, W>(xp, M, wp, K, op, ldo, N, b0, b1, tail);
    else
      block_rows16<6, W>(xp, M, wp, K, op, ldo, N, b0, b1, tail);
  } else if (bk.nt == 8) {
    block_rows<8, W>(xp, M, wp, K, op, ldo, N, b0, b1, tail);
  } else {
    block_rows<6, W>(xp, M, wp, K, op, ldo, N, b0, b1, tail);
  }
}

// all N weight rows, a block of them at a time, split between the threads; the last N % NT one by one
template <typename W>
static void skinny(const float* xp, int64_t M, const W* wp, int64_t K, float* op, int64_t N) {
  const Blocking bk = blocking(M);
  at::parallel_for(0, N / bk.nt, 16, [&](int64_t begin, int64_t end) {
    skinny_part(bk, xp, M, wp, K, op, N, N, begin, end, false);
  });
  skinny_part(bk, xp, M, wp, K, op, N, N, 0, 0, true);
}

// The decode plan's team (csrc/team.h): share `share` of `shares` of y = x @ w.T + bias into out [M, ldo],
// the blocks split as skinny_linear splits them; the first share also takes the last N % NT rows.
// x [M, K] fp32 contiguous; w and bias as skinny_linear_check passed them.
void skinny_linear_share(const float* x, int64_t M, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                         float* out, int64_t ldo, int64_t share, int64_t shares) {
  const int64_t N = w.size(0), K = w.size(1);
  const Blocking bk = blocking(M);
  const llmopt_team::Range r = llmopt_team::split(N / bk.nt, 16, share, shares);
  const bool tail = share == 0;
  if (w.dtype() == torch::kFloat32)
    skinny_part(bk, x, M, w.data_ptr<float>(), K, out, ldo, N, r.begin, r.end, tail);
  else
    skinny_part(bk, x, M, w.data_ptr<at::BFloat16>(), K, out, ldo, N, r.begin, r.end, tail);
  if (bias.has_value()) {
    const float* b = bias->data_ptr<float>();
    const auto add = [&](int64_t c0, int64_t c1) {
      for (int64_t m = 0; m < M; ++m)
        for (int64_t c = c0; c < c1; ++c) out[m * ldo + c] += b[c];
    };
    add(r.begin * bk.nt, r.end * bk.nt);
    if (tail) add(N / bk.nt * bk.nt, N);
  }
}

void skinny_linear_check(const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && (w.dtype() == torch::kFloat32 || w.dtype() == torch::kBFloat16),
              "dense_linear: contiguous fp32 or bf16 weight [N, K]");
  if (bias.has_value())
    TORCH_CHECK(bias->dtype() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == w.size(0),
                "dense_linear: bias fp32 [N]");
}

// fp32 x with fp32 or bf16 w (a bf16 copy of a wide weight halves the bytes a step reads)
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && (w.dtype() == torch::kFloat32 || w.dtype() == torch::kBFloat16),
              "skinny_linear: fp32 x, fp32 or bf16 w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "skinny_linear: contiguous inputs");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = torch::empty({M, N}, x.options());
  if (w.dtype() == torch::kFloat32)
    skinny<float>(x.data_ptr<float>(), M, w.data_ptr<float>(), K, out.data_ptr<float>(), N);
  else
    skinny<at::BFloat16>(x.data_ptr<float>(), M, w.data_ptr<at::BFloat16>(), K, out.data_ptr<float>(), N);
  if (bias.has_value()) out.add_(bias.value());
  return out;
}

#else  // no AVX2 + FMA: the caller keeps MKL (skinny_linear_available() says so)

bool skinny_linear_available() { return false; }

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(false, "skinny_linear: built without AVX2/FMA");
}
void skinny_linear_share(const float*, int64_t, const torch::Tensor&, const c10::optional<torch::Tensor>&, float*,
                         int64_t, int64_t, int64_t) {}
void skinny_linear_check(const torch::Tensor&, const c10::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "skinny_linear: built without AVX2/FMA");
}

#endif
