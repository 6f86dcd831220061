// The small per-layer ops of a decoder step, fused (fp32, CPU, AVX2 + FMA).
//
// Between the matmuls of a layer sit ~25 small PyTorch ops (RMSNorm's pow/mean/add/rsqrt/mul,
// rope's cat/neg/mul/add, silu, the gate*up product, a residual add). On a 32-token decode
// step each one is a few microseconds of arithmetic but tens of microseconds of dispatch. Each
// function here does one of those groups in one pass over the rows. Same formulas as the PyTorch reference in llmopt/model (checked against it
// in tests/test_cpu_fused_ops.py); only the summation order of the RMS differs.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>

#include "isa.h"
#if defined(__AVX2__) && defined(__FMA__)
#include "vec_math.h"

// rows per thread chunk: a decode batch (tens of rows) runs on one thread, no wake-up cost
static inline int64_t grain_for(int64_t cols) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1)); }

// out = w * (x / sqrt(mean(x^2) + eps)) for one row of h floats
static inline void rms_norm_row(const float* x, const float* w, float* out, int64_t h, float eps) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= h; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum8(acc);
  for (; i < h; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
  for (i = 0; i < h; ++i) out[i] = w[i] * (x[i] * r);
}

static void check_rows(const torch::Tensor& x, const torch::Tensor& w, const char* name) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32, name, ": fp32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.is_contiguous() && w.numel() == x.size(1),
              name, ": x [rows, hidden] contiguous, weight [hidden]");
}

bool fused_ops_available() { return true; }

// The row loops of rms_norm and add_rms_norm on raw rows, on the calling thread (the decode plan's
// team runs them on every thread, each on its own copy of the residual stream): one compiled
// instance for both callers, so the plan's rows are bitwise the module path's.
// x rows `ldx` floats apart -> out [n, h]
__attribute__((noinline)) void rms_norm_rows(const float* x, int64_t ldx, const float* w, float* out, int64_t n,
                                             int64_t h, float eps) {
  for (int64_t r = 0; r < n; ++r) rms_norm_row(x + r * ldx, w, out + r * h, h, eps);
}

// summed [n, h] = residual [n, h] + x (rows `ldx` floats apart; summed may be residual), then
// out [n, h] = w * norm(summed)
__attribute__((noinline)) void add_rms_norm_rows(const float* x, int64_t ldx, const float* residual, float* summed,
                                                 const float* w, float* out, int64_t n, int64_t h, float eps) {
  for (int64_t r = 0; r < n; ++r) {
    float* s = summed + r * h;
    const float* res = residual + r * h;
    const float* xr = x + r * ldx;
    for (int64_t i = 0; i < h; ++i) s[i] = res[i] + xr[i];
    rms_norm_row(s, w, out + r * h, h, eps);
  }
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, w, "rms_norm");
  const int64_t n = x.size(0), h = x.size(1);
  auto out = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, grain_for(h), [&](int64_t b, int64_t e) {
    rms_norm_rows(xp + b * h, h, wp, op + b * h, e - b, h, static_cast<float>(eps));
  });
  return out;
}

// add_rms_norm_rows for bf16 x rows (contiguous): each widened (exact), then the fp32 steps
static void add_rms_norm_rows_bf16(const c10::BFloat16* x, const float* residual, float* summed, const float* w,
                                   float* out, int64_t n, int64_t h, float eps) {
  for (int64_t r = 0; r < n; ++r) {
    float* s = summed + r * h;
    const float* res = residual + r * h;
    const c10::BFloat16* xr = x + r * h;
    for (int64_t i = 0; i < h; ++i) s[i] = res[i] + static_cast<float>(xr[i]);
    rms_norm_row(s, w, out + r * h, h, eps);
  }
}

// (w * norm(x + residual), x + residual): the residual add and the next RMSNorm in one pass. x fp32, or bf16 (a
// prompt-sized product's bf16 result): the same as on x widened to fp32
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  const bool bf16 = x.dtype() == torch::kBFloat16;
  check_rows(bf16 ? residual : x, w, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && x.is_contiguous() && residual.is_contiguous() &&
                  residual.dtype() == torch::kFloat32,
              "add_rms_norm: residual fp32 of x's shape, x fp32 or bf16");
  const int64_t n = x.size(0), h = x.size(1);
  auto summed = torch::empty_like(residual);
  auto out = torch::empty_like(residual);
  const float *rp = residual.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *sp = summed.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, n, grain_for(h), [&](int64_t b, int64_t e) {
    if (bf16)
      add_rms_norm_rows_bf16(x.data_ptr<c10::BFloat16>() + b * h, rp + b * h, sp + b * h, wp, op + b * h, e - b, h,
                             static_cast<float>(eps));
    else
      add_rms_norm_rows(x.data_ptr<float>() + b * h, h, rp + b * h, sp + b * h, wp, op + b * h, e - b, h,
                        static_cast<float>(eps));
  });
  return {out, summed};
}

void rotary_rows_(float* xp, int64_t n, int64_t heads, int64_t D, int64_t s0, int64_t s1, const float* cp,
                  const float* sp);

// rope in the "rotate half" layout, in place: for each head, with half = D / 2,
//   x[i]        <- x[i] * cos[i] - x[i + half] * sin[i]
//   x[i + half] <- x[i + half] * cos[i + half] + x[i] * sin[i + half]
// x: [tokens, heads, D] with unit stride along D (rows and heads may be strided, e.g. views
// into the fused qkv output); cos, sin: [tokens, D] contiguous
static void rotary_one(torch::Tensor& x, const float* cp, const float* sp) {
  rotary_rows_(x.data_ptr<float>(), x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1), cp, sp);
}

// the same on raw rows: n tokens of `heads` heads of D floats at x + t * s0 + head * s1
void rotary_rows_(float* xp, int64_t n, int64_t heads, int64_t D, int64_t s0, int64_t s1, const float* cp,
                  const float* sp) {
  const int64_t half = D / 2;
  at::parallel_for(0, n, grain_for(heads * D), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* c = cp + t * D;
      const float* s = sp + t * D;
      for (int64_t hd = 0; hd < heads; ++hd) {
        float* v = xp + t * s0 + hd * s1;
        for (int64_t i = 0; i < half; ++i) {
          const float lo = v[i], hi = v[i + half];
          v[i] = lo * c[i] - hi * s[i];
          v[i + half] = hi * c[i + half] + lo * s[i + half];
        }
      }
    }
  });
}

void rotary_embedding_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  for (const auto* t : {&q, &k})
    TORCH_CHECK(t->dtype() == torch::kFloat32 && t->dim() == 3 && t->stride(2) == 1 && t->size(2) % 2 == 0,
                "rotary_embedding_: q, k fp32 [tokens, heads, D], unit stride along D, D even");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dtype() == torch::kFloat32 &&
                  cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == q.size(0) &&
                  cos.size(1) == q.size(2) && k.size(0) == q.size(0) && k.size(2) == q.size(2),
              "rotary_embedding_: cos, sin fp32 [tokens, D] contiguous");
  rotary_one(q, cos.data_ptr<float>(), sin.data_ptr<float>());
  rotary_one(k, cos.data_ptr<float>(), sin.data_ptr<float>());
}

// 8 floats rounded to bf16 as c10::BFloat16 (and PyTorch's .to(torch.bfloat16)) rounds: to nearest even, NaN -> 0x7FC0
static inline void store8_bf16(c10::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

static inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline void store8(c10::BFloat16* p, __m256 v) { store8_bf16(p, v); }

#if LLMOPT_COMPILED_AVX512
// store8 and load8 on 16 lanes, bitwise the same per lane
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
static inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline void store16(c10::BFloat16* p, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
#endif

// columns [c0, c1) of silu(gate) * up for n rows of [gate | up] in T (float or bf16; rows `ldx` apart) into
// out (rows `ldo` apart), computed in fp32 (bf16: widened, then rounded once). c0 a multiple of 8 and c1
// one or I: each column takes the vector or the scalar code as it does over the whole row.
template <typename T>
static void silu_and_mul_cols(const T* xp, int64_t ldx, T* op, int64_t ldo, int64_t n, int64_t I, int64_t c0,
                              int64_t c1) {
  const __m256 one = _mm256_set1_ps(1.f);
#if LLMOPT_COMPILED_AVX512
  // 16 lanes where the AVX-512 path is on: the 8-lane steps per lane (bitwise the same result), half the instructions
  const bool wide = llmopt_isa::active_isa() >= llmopt_isa::kAvx512;
#endif
  for (int64_t r = 0; r < n; ++r) {
    const T* g = xp + r * ldx;
    const T* u = g + I;
    T* o = op + r * ldo;
    int64_t i = c0;
#if LLMOPT_COMPILED_AVX512
    if (wide) {
      const __m512 one16 = _mm512_set1_ps(1.f);
      for (; i + 16 <= c1; i += 16) {
        const __m512 gv = load16(g + i);
        const __m512 sig = _mm512_div_ps(gv, _mm512_add_ps(one16, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        store16(o + i, _mm512_mul_ps(sig, load16(u + i)));
      }
    }
#endif
    for (; i + 8 <= c1; i += 8) {
      const __m256 gv = load8(g + i);
      const __m256 sig = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
      store8(o + i, _mm256_mul_ps(sig, load8(u + i)));
    }
    for (; i < c1; ++i) {
      const float gi = static_cast<float>(g[i]);
      o[i] = static_cast<T>(gi / (1.f + std::exp(-gi)) * static_cast<float>(u[i]));
    }
  }
}

// fp32 rows for the decode plan's team (columns [c0, c1), as above)
void silu_and_mul_rows_f32(const float* x, int64_t ldx, float* out, int64_t ldo, int64_t n, int64_t I, int64_t c0,
                           int64_t c1) {
  silu_and_mul_cols(x, ldx, out, ldo, n, I, c0, c1);
}

// rows of [gate | up] in T -> silu(gate) * up in T
template <typename T>
static void silu_and_mul_rows(const T* xp, T* op, int64_t n, int64_t I) {
  at::parallel_for(0, n, grain_for(2 * I), [&](int64_t b, int64_t e) {
    silu_and_mul_cols(xp + b * 2 * I, 2 * I, op + b * I, I, e - b, I, 0, I);
  });
}

// x [rows, 2 * I] = [gate | up] -> silu(gate) * up [rows, I], fp32 or bf16 in and out. bf16: what the fp32 op
// gives on the widened input, rounded to bf16 (the bf16 product of a prompt-sized gate_up projection goes
// straight to the down projection, which rounds its input to bf16 anyway)
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK((x.dtype() == torch::kFloat32 || x.dtype() == torch::kBFloat16) && x.dim() == 2 && x.is_contiguous() &&
                  x.size(1) % 2 == 0,
              "silu_and_mul: x fp32 or bf16 [rows, 2 * I] contiguous");
  const int64_t n = x.size(0), I = x.size(1) / 2;
  auto out = torch::empty({n, I}, x.options());
  if (x.dtype() == torch::kBFloat16)
    silu_and_mul_rows(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), n, I);
  else
    silu_and_mul_rows(x.data_ptr<float>(), out.data_ptr<float>(), n, I);
  return out;
}

#else  // no AVX2 + FMA: the model keeps its PyTorch ops (fused_ops_available() says so)

bool fused_ops_available() { return false; }
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor, double) { TORCH_CHECK(false, "built without AVX2/FMA"); }
std::vector<torch::Tensor> add_rms_norm(torch::Tensor, torch::Tensor, torch::Tensor, double) {
  TORCH_CHECK(false, "built without AVX2/FMA");
}
void rotary_embedding_(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor) { TORCH_CHECK(false, "built without AVX2/FMA"); }
void rotary_rows_(float*, int64_t, int64_t, int64_t, int64_t, int64_t, const float*, const float*) {
  TORCH_CHECK(false, "built without AVX2/FMA");
}
torch::Tensor silu_and_mul(torch::Tensor) { TORCH_CHECK(false, "built without AVX2/FMA"); }
void rms_norm_rows(const float*, int64_t, const float*, float*, int64_t, int64_t, float) {}
void add_rms_norm_rows(const float*, int64_t, const float*, float*, const float*, float*, int64_t, int64_t, float) {}
void silu_and_mul_rows_f32(const float*, int64_t, float*, int64_t, int64_t, int64_t, int64_t, int64_t) {}

#endif
