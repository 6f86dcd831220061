// The weight error of group-wise integer rounding, in one pass: what AWQ's searches measure
// for every candidate (CPU, float32).
//
//     v = clamp(w * s[col], -limit[row, group], limit[row, group])     (s and limit optional)
//     scale, zero = the group's grid (llmopt/quant/quantizer.py: grid_params)
//     error = ((clamp(round(v / scale) + zero, 0, max_code) - zero) * scale) / s[col] - w
//
// The PyTorch reference (`fake_quantize(w * s).div_(s).sub_(w)`, and the clipped form) makes
// ~12 passes over the weight, each a new or rewritten tensor; here each (row, group) is read
// twice from cache and the error written once. Every step is the reference's IEEE operation
// in the reference's order (no operation here can contract into an FMA, and the scale is
// rounded to fp16 as a checkpoint stores it), so the result equals the reference bit for bit
// (tests/test_fake_quant_kernel.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <limits>

namespace {

template <bool kScale, bool kLimit>
inline float scaled_clamped(float w, const float* s, int64_t i, float limit) {
  float v = kScale ? w * s[i] : w;
  if (kLimit) v = std::min(std::max(v, -limit), limit);
  return v;
}

template <bool kScale, bool kLimit>
void group_error(const float* w, const float* s, float limit, int64_t width, float max_code, bool sym, float* out) {
  float scale, zero;
  if (sym) {
    float absmax = 0.f;
    for (int64_t i = 0; i < width; ++i) absmax = std::max(absmax, std::abs(scaled_clamped<kScale, kLimit>(w[i], s, i, limit)));
    scale = std::max(2.f * absmax / max_code, 1e-5f);
    zero = std::floor((max_code + 1.f) / 2.f);
  } else {
    float lo = std::numeric_limits<float>::infinity(), hi = -lo;
    for (int64_t i = 0; i < width; ++i) {
      const float v = scaled_clamped<kScale, kLimit>(w[i], s, i, limit);
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    lo = std::min(lo, 0.f);
    hi = std::max(hi, 0.f);
    scale = std::max((hi - lo) / max_code, 1e-5f);
    zero = std::min(std::max(std::nearbyint(-lo / scale), 0.f), max_code);
    if (zero == 0.f) {  // GPTQ v1 cannot store zero point 0 (grid_params)
      scale = std::max(hi / (max_code - 1.f), 1e-5f);
      zero = 1.f;
    }
  }
  scale = static_cast<float>(c10::Half(scale));  // round to nearest even, as tensor.half()
  for (int64_t i = 0; i < width; ++i) {
    const float v = scaled_clamped<kScale, kLimit>(w[i], s, i, limit);
    const float code = std::min(std::max(std::rint(v / scale) + zero, 0.f), max_code);
    const float w_hat = (code - zero) * scale;
    out[i] = kScale ? w_hat / s[i] - w[i] : w_hat - w[i];
  }
}

template <bool kScale, bool kLimit>
void rows_error(const float* w, const float* s, const float* limit, int64_t rows, int64_t n, int64_t width,
                float max_code, bool sym, float* out) {
  const int64_t groups = n / width;
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = r * n + g * width;
        group_error<kScale, kLimit>(w + at, kScale ? s + g * width : nullptr, kLimit ? limit[r * groups + g] : 0.f,
                                    width, max_code, sym, out + at);
      }
  });
}

}  // namespace

torch::Tensor fake_quant_error(torch::Tensor w, torch::Tensor col_scale, torch::Tensor limit, int64_t width,
                               int64_t max_code, bool sym) {
  TORCH_CHECK(w.dtype() == torch::kFloat32 && w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(),
              "fake_quant_error: w float32 [rows, n], contiguous, on the CPU");
  const int64_t rows = w.size(0), n = w.size(1);
  TORCH_CHECK(width > 0 && n % width == 0, "fake_quant_error: the group width must divide n");
  TORCH_CHECK(max_code >= 2, "fake_quant_error: max_code >= 2");
  const bool scaled = col_scale.numel() > 0, limited = limit.numel() > 0;
  TORCH_CHECK(!scaled || (col_scale.dtype() == torch::kFloat32 && col_scale.is_contiguous() && col_scale.numel() == n),
              "fake_quant_error: col_scale float32 [n]");
  TORCH_CHECK(!limited || (limit.dtype() == torch::kFloat32 && limit.is_contiguous() && limit.numel() == rows * (n / width)),
              "fake_quant_error: limit float32 [rows, groups]");
  auto out = torch::empty_like(w);
  const float* wp = w.data_ptr<float>();
  const float* sp = scaled ? col_scale.data_ptr<float>() : nullptr;
  const float* lp = limited ? limit.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const float mc = static_cast<float>(max_code);
  if (scaled && limited) rows_error<true, true>(wp, sp, lp, rows, n, width, mc, sym, op);
  else if (scaled) rows_error<true, false>(wp, sp, lp, rows, n, width, mc, sym, op);
  else if (limited) rows_error<false, true>(wp, sp, lp, rows, n, width, mc, sym, op);
  else rows_error<false, false>(wp, sp, lp, rows, n, width, mc, sym, op);
  return out;
}
