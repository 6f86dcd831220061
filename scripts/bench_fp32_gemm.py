"""fp32 prompt-sized products of the default model's projections through each CPU GEMM llmopt can
take (`llmopt.kernels.cpu_linear`): MKL (`F.linear`), oneDNN on the plain weight (`onednn_linear`),
oneDNN's bf16 math mode (`bf16_linear`), and bf16 tensors for reference (bf16 result).

    python scripts/bench_fp32_gemm.py --rows 2048 --threads 2

Each way runs in turn within each round (machine load hits them alike); the figure is the best
round's ms per call, with GFLOP/s, and the largest error against the float64 product relative to
the largest output.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from llmopt.kernels.cpu_linear import bf16_linear, fp32_gemm, onednn_linear

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}  # (K, N)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    ways = {"mkl": F.linear, "onednn": onednn_linear, "bf16_math": bf16_linear,
            "bf16_tensors": lambda x, w: F.linear(x.bfloat16(), w.bfloat16()).float()}
    print(f"{args.rows} rows, {args.threads} thread(s); this CPU's fp32 GEMM: {fp32_gemm()}")
    totals = dict.fromkeys(ways, 0.0)
    for name, (k, n) in SHAPES.items():
        x, w = torch.randn(args.rows, k, generator=gen), torch.randn(n, k, generator=gen) * k ** -0.5
        ref = x.double() @ w.double().T
        best = dict.fromkeys(ways, float("inf"))
        for _ in range(args.rounds):
            for way, fn in ways.items():
                fn(x, w)
                start = time.perf_counter()
                fn(x, w)
                best[way] = min(best[way], time.perf_counter() - start)
        flops = 2 * args.rows * k * n
        cells = []
        for way, fn in ways.items():
            err = ((fn(x, w).double() - ref).abs().max() / ref.abs().max()).item()
            cells.append(f"{way} {best[way] * 1e3:.2f} ms ({flops / best[way] / 1e9:.0f} GF/s, err {err:.1e})")
            totals[way] += best[way]
        print(f"{name:8s}", " | ".join(cells))
    print("a layer's four:", ", ".join(f"{way} {t * 1e3:.1f} ms" for way, t in totals.items()))


if __name__ == "__main__":
    main()
