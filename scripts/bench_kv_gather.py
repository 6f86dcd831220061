"""How fast this machine can gather a decode step's K rows from a paged pool at all, in three walks, with loads
and sums only (no attention arithmetic): the pool as the runtime lays it out ([slots, kv heads, head dim], a
position's row of one kv head 256 B every 768 B at the default model's shape) walked per (sequence, kv head) as
the CPU decode kernel does, the same walk over a head-major block ([blocks, kv heads, block size, head dim]), and
per sequence over all kv heads at once. 2 threads (OpenMP), T1 software prefetch some positions ahead, other
memory read between runs so the pool comes from DRAM, the pool in huge pages as the runtime's (`--pages 4k`:
4 KiB pages); prints GB/s per walk (median of 5), `--rounds` times.

    python scripts/bench_kv_gather.py                       # batch 8 x 576 tokens, 30 layers, 3 kv heads x 64, fp32
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r'''
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <vector>

// unit = (layer, sequence, kv head) [per_head] or (layer, sequence) [all heads]; returns a sum so nothing is elided
double walk(torch::Tensor pool, torch::Tensor tables, int64_t layers, int64_t B, int64_t ctx, int64_t KVH, int64_t D,
            int64_t bs, int64_t mode, int64_t ahead) {
  const float* p = pool.data_ptr<float>();
  const int64_t* t = tables.data_ptr<int64_t>();
  const int64_t W = tables.size(1), layer_elems = pool.size(0) / layers;
  const bool all_heads = mode == 2, head_major = mode == 1;
  const int64_t heads = all_heads ? 1 : KVH, span = all_heads ? KVH * D : D;
  double total = 0;
  #pragma omp parallel for reduction(+:total) schedule(static) num_threads(2)
  for (int64_t u = 0; u < layers * B * heads; ++u) {
    const int64_t l = u / (B * heads), b = (u / heads) % B, h = u % heads;
    const float* base = p + l * layer_elems;
    auto row = [&](int64_t pos) {
      const int64_t blk = t[b * W + pos / bs], off = pos % bs;
      return head_major ? base + ((blk * KVH + h) * bs + off) * D : base + ((blk * bs + off) * KVH + h) * D;
    };
    // the rows' addresses first, as the kernel walks the block table once a unit (an address per load,
    // with its two integer divisions, bounded an earlier version of this walk), then loads into 4
    // independent sums (one chain of adds would bound the walk by their latency)
    std::vector<const float*> rows(ctx);
    for (int64_t i = 0; i < ctx; ++i) rows[i] = row(i);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < ctx; ++i) {
      if (ahead > 0 && i + ahead < ctx) {
        const float* r = rows[i + ahead];
        for (int64_t d = 0; d < span; d += 16) _mm_prefetch(reinterpret_cast<const char*>(r + d), _MM_HINT_T1);
      }
      const float* r = rows[i];
      int64_t d = 0;
      for (; d + 32 <= span; d += 32) {
        a0 = _mm256_add_ps(a0, _mm256_loadu_ps(r + d));
        a1 = _mm256_add_ps(a1, _mm256_loadu_ps(r + d + 8));
        a2 = _mm256_add_ps(a2, _mm256_loadu_ps(r + d + 16));
        a3 = _mm256_add_ps(a3, _mm256_loadu_ps(r + d + 24));
      }
      for (; d + 8 <= span; d += 8) a0 = _mm256_add_ps(a0, _mm256_loadu_ps(r + d));
    }
    const __m256 acc = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (float v : lanes) total += v;
  }
  return total;
}
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=576)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pool-blocks", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pages", choices=["huge", "4k"], default="huge",
                        help="the pool in transparent huge pages (as the runtime's) or 4 KiB pages")
    args = parser.parse_args()
    ext = load_inline("llmopt_kv_gather_probe", cpp_sources=SOURCE, functions=["walk"],
                      extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    kvh, d, bs = args.kv_heads, args.head_dim, args.block_size
    if args.pages == "huge":  # as the runtime allocates its pools
        from llmopt.runtime.model_runner import zeroed

        pool = zeroed((args.layers * args.pool_blocks * bs * kvh * d,), torch.float32, torch.device("cpu")).normal_()
    else:
        pool = torch.randn(args.layers * args.pool_blocks * bs * kvh * d)
    width = -(-args.context // bs)
    tables = torch.stack([torch.randperm(args.pool_blocks)[:width] for _ in range(args.batch)]).long()
    other = torch.randn(32 << 20)  # 128 MB read between runs
    step_bytes = args.layers * args.batch * args.context * kvh * d * 4
    walks = [("per kv head, the runtime's layout", 0, [0, 16, 32]), ("per kv head, head-major blocks", 1, [16, 32]),
             ("all kv heads a sweep, the runtime's layout", 2, [0, 4, 8, 16])]
    for _ in range(args.rounds):
        for name, mode, aheads in walks:
            cells = []
            for ahead in aheads:
                times = []
                for _ in range(5):
                    other.sum()
                    start = time.perf_counter()
                    ext.walk(pool, tables, args.layers, args.batch, args.context, kvh, d, bs, mode, ahead)
                    times.append(time.perf_counter() - start)
                cells.append(f"{ahead} ahead {step_bytes / sorted(times)[2] / 1e9:.1f} GB/s")
            print(f"{name}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
