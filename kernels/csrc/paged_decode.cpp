// Paged decode attention for fp32 on CPU: one query token per sequence against its K/V,
// read straight from the block pool through the block table (no gather), each key and value
// row once for all the query heads that share it (grouped-query attention). Two-pass softmax
// per (sequence, kv head). The pure-PyTorch path (kernels/paged_attention.py) is the reference.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

// 8 independent partial sums: the compiler vectorises this without reassociating floats
static inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// exp for 8 floats: Cephes' expf (range reduction by ln 2, degree-5 polynomial, then scale
// by 2^n through the exponent bits), within 2 ulp of std::exp for the softmax's inputs (<= 0).
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365f));  // exp underflows below this (2^-126)
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762f));
  const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i n = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
  return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(n, 23)));
}

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

#else

static inline float exp_shifted(float* s, int64_t n, float m) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  return sum;
}

#endif

// q [B, H, D]; k_cache, v_cache [slots, KVH, D]; block_tables [B, W]; context_lens [B]
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens,
                           int64_t block_size, double scale, int64_t sliding_window) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32, "fp32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.dtype() == torch::kInt64 && context_lens.dtype() == torch::kInt64, "int64 tables");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(1), G = H / KVH, W = tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* bt = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(G * D), maxes(G), sums(G);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, kh = item % KVH, len = lp[b];
      const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
      const int64_t n = len - start;
      const float* qg = qp + (b * H + kh * G) * D;
      const int64_t* table = bt + b * W;
      scores.resize(G * n);  // [G][n]: each head's scores contiguous for the softmax
      std::fill(maxes.begin(), maxes.end(), -std::numeric_limits<float>::infinity());
      // fn(i, row) for the i-th attended position's row of this kv head in `cache`, walking
      // the block table block by block (no division per token)
      auto for_each_row = [&](const float* cache, auto&& fn) {
        for (int64_t t = start; t < len;) {
          const int64_t block = t / block_size, offset = t - block * block_size;
          const int64_t stop = std::min(len, (block + 1) * block_size);
          const float* row = cache + ((table[block] * block_size + offset) * KVH + kh) * D;
          for (; t < stop; ++t, row += KVH * D) fn(t - start, row);
        }
      };
      for_each_row(kp, [&](int64_t i, const float* kr) {
        for (int64_t g = 0; g < G; ++g) {
          const float s = dot(qg + g * D, kr, D) * fscale;
          scores[g * n + i] = s;
          maxes[g] = std::max(maxes[g], s);
        }
      });
      for (int64_t g = 0; g < G; ++g) sums[g] = exp_shifted(scores.data() + g * n, n, maxes[g]);
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_row(vp, [&](int64_t i, const float* vr) {
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * n + i];
          float* __restrict__ a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * vr[d];
        }
      });
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + (b * H + kh * G + g) * D;
        const float inv = 1.f / sums[g];
        for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv;
      }
    }
  });
  return out;
}
