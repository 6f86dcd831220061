"""Paged decode attention for fp32 on CPU, as a small C++ kernel compiled on first use.

The pure-PyTorch path (`paged_attention.paged_decode_attention`) gathers every sequence's
K/V blocks into a fresh tensor and then runs SDPA over it: the cache is read, written and
read again. This kernel reads each key and value row once, straight from the block pool,
for all the query heads that share it (grouped-query attention), with a two-pass softmax
per (sequence, kv head). Same inputs, same result up to float rounding.

It is built with `torch.utils.cpp_extension.load_inline` (g++ and ninja) into
`$LLMOPT_CACHE/torch_extensions/<cpu flags hash>/`, because `-march=native` code must
not move to another CPU. Where it cannot be built (no compiler), or with
`LLMOPT_CPU_KERNELS=0`, `decode_kernel()` returns None and the runtime keeps the
PyTorch path, which stays the reference the tests compare against.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Callable

log = logging.getLogger("llmopt.kernels")

_SOURCE = r"""
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
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        const float m = maxes[g];
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) {
          sg[i] = std::exp(sg[i] - m);
          sum += sg[i];
        }
        sums[g] = sum;
      }
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
"""

_UNSET = object()
_kernel: object = _UNSET


def _build_dir() -> Path:
    """Per CPU model and flags: -march=native code is only valid on the CPU it was built for."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
        model = next((line for line in info.splitlines() if line.startswith("model name")), "")
    except OSError:
        flags = model = ""
    import torch

    digest = hashlib.sha256(f"{model}|{flags}|{torch.__version__}|{_SOURCE}".encode()).hexdigest()[:16]
    from llmopt.core.embedded import cache_root

    return cache_root() / "torch_extensions" / digest


def decode_kernel() -> Callable | None:
    """The compiled `paged_decode` function, or None where it cannot be built (then use PyTorch)."""
    global _kernel
    if _kernel is not _UNSET:
        return _kernel  # type: ignore[return-value]
    _kernel = None
    if os.environ.get("LLMOPT_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        folder = _build_dir()
        folder.mkdir(parents=True, exist_ok=True)
        if not any(folder.glob("*.so")):
            log.info("building the CPU paged-attention kernel (once per machine, ~30 s) in %s", folder)
        module = load_inline(name="llmopt_cpu_paged_attention", cpp_sources=[_SOURCE], functions=["paged_decode"],
                             extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)
        _kernel = module.paged_decode
    except Exception as exc:  # no compiler, no ninja, a build error: the PyTorch path still works
        log.warning("CPU paged-attention kernel unavailable (%s); using the PyTorch path",
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return _kernel  # type: ignore[return-value]
