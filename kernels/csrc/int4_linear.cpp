// y = x @ dequant(W).T (+ bias) for 4-bit AWQ / GPTQ weights on CPU, fp32 in and out.
//
// Decode reads every weight once per step, so the bytes of the weights set the floor: 4-bit
// codes are 8x fewer than fp32. The activations are quantized on the fly to int8, one scale
// per 32 values (llama.cpp's Q8_1 for its Q4_1 x Q8_1 dot product), so weights meet them in
// integer dot products: AVX2's maddubs (u8 codes x s8 activations -> s16 pairs). With fp32
// activations every weight would need its own convert-and-FMA instead (~3x the instructions);
// the int8 rounding costs a KLD measured in docs/benchmarks.md.
//
// Weight layout (repacked once at load by kernels/cpu_int4.py): output rows in tiles of 8,
// interleaved so that one 32-byte load holds 4 consecutive codes of each of the 8 rows (low
// nibbles) and 4 more, 16 columns on (high nibbles). Per 32 columns of a tile: 4 loads give 8
// registers; each meets a broadcast of the matching 4 activation bytes in one maddubs, the 8
// s16 results add up (|sum| <= 8 * 2 * 15 * 127 < 2^15), and one madd leaves the 8 rows' dot
// products in the 8 lanes: no horizontal sums, and the group scales of 8 rows are one vector.
// Groups are contiguous runs of `group_blocks` blocks of 32 columns with a float scale s and
// s * zero per row: w = (code - zero) * s, so a group's dot product is
// s * sum(code * x) - s * zero * sum(x), the second term from the activations' block sums.
//
// Every output element is the same arithmetic whatever the tile it falls in and however many
// rows x has (per block: one integer dot, one FMA into its lane; per group one FMA for the zero
// term): a sequence's result does not depend on the rest of the batch, and prompt chunks and
// decode steps compute a token's projections identically.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;

// Activations of M rows quantized per 32-value block: codes, block scales, and per weight
// group the sum over its blocks of scale * sum(codes) (the zero-point term's factor).
struct QuantizedRows {
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> d;      // [M, K / 32]
  std::vector<float> gsum;   // [M, groups]
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

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K, int64_t group_blocks, const int64_t* perm) {
  const int64_t nb = K / kBlock, groups = nb / group_blocks;
  QuantizedRows r{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * groups)};
  std::vector<float> row(perm != nullptr ? K : 0);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    if (perm != nullptr) {  // act-order checkpoints: columns in the order the groups were stored
      for (int64_t k = 0; k < K; ++k) row[k] = xr[perm[k]];
      xr = row.data();
    }
    for (int64_t g = 0; g < groups; ++g) {
      float gs = 0.f;
      for (int64_t b = g * group_blocks; b < (g + 1) * group_blocks; ++b) {
        int32_t sum;
        quantize_block_scalar(xr + b * kBlock, r.q.data() + m * K + b * kBlock, r.d.data() + m * nb + b, &sum);
        gs = std::fma(r.d[m * nb + b], static_cast<float>(sum), gs);
      }
      r.gsum[m * groups + g] = gs;
    }
  }
  return r;
}

constexpr int64_t kTile = 8;  // output rows interleaved together

struct Int4Weights {
  const uint8_t* codes;  // [N / 8, K / 32, 128]: tile, block, interleaved bytes
  const float* scales;   // [N / 8, groups, 8]
  const float* scaled_zeros;  // [N / 8, groups, 8]: scale * zero
  int64_t K, groups, group_blocks;
};

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// the 8 output rows of tile `t` against MT rows of x (from m0); out has row stride ldo
template <int MT>
inline void int4_tile(const Int4Weights& W, int64_t t, const QuantizedRows& X, int64_t m0, float* out, int64_t ldo) {
  const int64_t K = W.K, G = W.groups, nb = K / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[MT], zacc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = zacc[m] = _mm256_setzero_ps();
  const uint8_t* codes = W.codes + t * nb * 128;
  const float* scales = W.scales + t * G * kTile;
  const float* zeros = W.scaled_zeros + t * G * kTile;
  for (int64_t g = 0; g < G; ++g) {
    const __m256 vs = _mm256_loadu_ps(scales + g * kTile);
    for (int64_t b = g * W.group_blocks; b < (g + 1) * W.group_blocks; ++b) {
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
    const __m256 vz = _mm256_loadu_ps(zeros + g * kTile);
    for (int m = 0; m < MT; ++m) zacc[m] = _mm256_fmadd_ps(vz, _mm256_set1_ps(X.gsum[(m0 + m) * G + g]), zacc[m]);
  }
  for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out + m * ldo, _mm256_sub_ps(acc[m], zacc[m]));
}

struct Int8Weights {
  const int8_t* codes;  // [N / 8, K / 32, 256]: tile, block, 8 chunks of 4 columns x 8 rows
  const float* scales;  // [N / 8, K / 32, 8]
  int64_t K;
};

// Symmetric 8-bit weights (llama.cpp's Q8_0: one scale per 32 columns) against int8
// activations: maddubs needs an unsigned operand, so |w| meets x with w's sign moved onto it.
template <int MT>
inline void int8_tile(const Int8Weights& W, int64_t t, const QuantizedRows& X, int64_t m0, float* out, int64_t ldo) {
  const int64_t K = W.K, nb = K / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* wb = W.codes + (t * nb + b) * 256;
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
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]), _mm256_mul_ps(vs, _mm256_set1_ps(X.d[(m0 + m) * nb + b])), acc[m]);
  }
  for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out + m * ldo, acc[m]);
}

bool int4_simd() { return true; }

#else  // portable C++: the same blocks and sums (not bitwise the AVX2 order)

template <int MT>
inline void int4_tile(const Int4Weights& W, int64_t t, const QuantizedRows& X, int64_t m0, float* out, int64_t ldo) {
  const int64_t K = W.K, G = W.groups, nb = K / kBlock;
  const uint8_t* codes = W.codes + t * nb * 128;
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < kTile; ++r) {
      const int8_t* x = X.q.data() + (m0 + m) * K;
      float acc = 0.f, zacc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const float s = W.scales[(t * G + g) * kTile + r];
        for (int64_t b = g * W.group_blocks; b < (g + 1) * W.group_blocks; ++b) {
          int32_t dot = 0;
          for (int c = 0; c < 4; ++c)
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = codes[b * 128 + c * 32 + r * 4 + i];
              dot += (byte & 0x0F) * x[b * kBlock + c * 4 + i] + (byte >> 4) * x[b * kBlock + 16 + c * 4 + i];
            }
          acc = std::fma(static_cast<float>(dot), s * X.d[(m0 + m) * nb + b], acc);
        }
        zacc = std::fma(W.scaled_zeros[(t * G + g) * kTile + r], X.gsum[(m0 + m) * G + g], zacc);
      }
      out[m * ldo + r] = acc - zacc;
    }
}

struct Int8Weights {
  const int8_t* codes;
  const float* scales;
  int64_t K;
};

template <int MT>
inline void int8_tile(const Int8Weights& W, int64_t t, const QuantizedRows& X, int64_t m0, float* out, int64_t ldo) {
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

bool int4_simd() { return false; }

#endif

// one tile of 8 output rows against all M rows of x: 4 x-rows at a time, then one by one
inline void tile_rows(const Int4Weights& W, int64_t t, const QuantizedRows& X, int64_t M, float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) int4_tile<4>(W, t, X, m, out + m * ldo + t * kTile, ldo);
  for (; m < M; ++m) int4_tile<1>(W, t, X, m, out + m * ldo + t * kTile, ldo);
}

inline void int8_tile_rows(const Int8Weights& W, int64_t t, const QuantizedRows& X, int64_t M, float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) int8_tile<4>(W, t, X, m, out + m * ldo + t * kTile, ldo);
  for (; m < M; ++m) int8_tile<1>(W, t, X, m, out + m * ldo + t * kTile, ldo);
}

}  // namespace

bool int4_linear_simd() { return int4_simd(); }

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor scaled_zeros,
                          int64_t out_features, int64_t group_size, c10::optional<torch::Tensor> perm,
                          c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "int4_linear: x fp32 [M, K] contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.dim() == 2 && codes.is_contiguous() && codes.size(1) * 2 == K * kTile,
              "int4_linear: codes uint8 [N / 8, K * 4] contiguous");
  const int64_t tiles = codes.size(0), N = out_features;
  TORCH_CHECK(K % kBlock == 0, "int4_linear: K must be a multiple of 32");
  TORCH_CHECK(N > (tiles - 1) * kTile && N <= tiles * kTile, "int4_linear: out_features does not match the codes");
  TORCH_CHECK(group_size % kBlock == 0 && K % group_size == 0, "int4_linear: group size must be a multiple of 32 dividing K");
  const int64_t groups = K / group_size;
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scaled_zeros.dtype() == torch::kFloat32 && scales.is_contiguous() &&
                  scaled_zeros.is_contiguous() && scales.numel() == tiles * kTile * groups &&
                  scaled_zeros.numel() == tiles * kTile * groups,
              "int4_linear: scales and scaled zeros fp32 [N / 8, K / group_size, 8]");
  const int64_t* perm_ptr = nullptr;
  if (perm.has_value()) {
    TORCH_CHECK(perm->dtype() == torch::kInt64 && perm->numel() == K && perm->is_contiguous(), "int4_linear: perm int64 [K]");
    perm_ptr = perm->data_ptr<int64_t>();
  }
  // an output width that is not a multiple of 8 computes the padded rows and drops them
  auto padded = torch::empty({M, tiles * kTile}, x.options());
  if (M > 0) {
    const QuantizedRows X = quantize_rows(x.data_ptr<float>(), M, K, group_size / kBlock, perm_ptr);
    const Int4Weights W{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), scaled_zeros.data_ptr<float>(), K, groups,
                        group_size / kBlock};
    float* op = padded.data_ptr<float>();
    const int64_t ldo = tiles * kTile;
    at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) tile_rows(W, t, X, M, op, ldo);
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
    const QuantizedRows X = quantize_rows(x.data_ptr<float>(), M, K, 1, nullptr);
    const Int8Weights W{codes.data_ptr<int8_t>(), scales.data_ptr<float>(), K};
    float* op = padded.data_ptr<float>();
    const int64_t ldo = tiles * kTile;
    at::parallel_for(0, tiles, 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) int8_tile_rows(W, t, X, M, op, ldo);
    });
  }
  return N == tiles * kTile ? padded : padded.narrow(1, 0, N).contiguous();
}
