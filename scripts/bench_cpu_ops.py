#!/usr/bin/env python
"""Micro-benchmarks behind the runtime notes in docs/benchmarks.md (fp32, CPU, this machine's threads).

1. Decode attention, one layer call: the C++ kernel (`llmopt.kernels.cpu_paged_attention`)
   vs the PyTorch path (gather the blocks, then SDPA), at the default model's shape
   (9 query heads, 3 KV heads, head dim 64), 32 sequences x --context tokens, blocks
   scattered through a 3,200-block pool. The same K/V is reused call after call, so it
   sits in cache: an upper bound on what the kernel gains inside the model.
2. The default model's linears at M rows (qkv 576->960, o 576->576, gate_up 576->3072,
   down 1536->576, lm_head 576->49152): MKL (`F.linear`, what transformers runs) vs a
   oneDNN-packed weight, and a 2048^3 GEMM for the machine's large-GEMM rate.

    python scripts/bench_cpu_ops.py [--context 242] [--rows 1,32]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from llmopt.kernels.cpu_paged_attention import decode_kernel
from llmopt.kernels.paged_attention import decode_mask, paged_decode_attention

LINEARS = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}


def per_call_ms(fn, min_seconds: float = 0.5) -> float:
    for _ in range(3):
        fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e3


def attention(context: int) -> None:
    gen = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, head_dim, block_size, num_blocks = 32, 9, 3, 64, 16, 3200
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen)
    width = -(-context // block_size)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, width)
    lens = torch.full((batch,), context)
    q = torch.randn(batch, heads, head_dim, generator=gen)
    kernel = decode_kernel()

    def pytorch_path():
        return paged_decode_attention(q, k_cache, v_cache, tables, decode_mask(lens, width * block_size, None))

    print(f"decode attention, {batch} sequences x {context} tokens, {torch.get_num_threads()} threads:")
    ref = per_call_ms(pytorch_path)
    print(f"  PyTorch gather + SDPA   {ref:7.3f} ms")
    if kernel is None:
        print("  C++ kernel              not available here")
        return
    ms = per_call_ms(lambda: kernel(q, k_cache, v_cache, tables, lens, block_size, head_dim ** -0.5, -1))
    print(f"  C++ kernel              {ms:7.3f} ms  ({ms / ref:.2f}x)")


def linears(rows: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(2048, 2048, generator=gen), torch.randn(2048, 2048, generator=gen)
    ms = per_call_ms(lambda: a @ b)
    print(f"\nlarge GEMM 2048^3: {2 * 2048 ** 3 / ms / 1e6:.0f} GFLOPS")
    print(f"\n{'M':>4} {'layer':8} {'MKL ms':>8} {'oneDNN ms':>10} {'ratio':>6} {'MKL GFLOPS':>11} {'max |diff|':>10}")
    for m in rows:
        for name, (n_in, n_out) in LINEARS.items():
            w, x = torch.randn(n_out, n_in, generator=gen) * 0.05, torch.randn(m, n_in, generator=gen)
            packed = w.to_mkldnn()
            mkl = per_call_ms(lambda: F.linear(x, w))
            onednn = per_call_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
            diff = (F.linear(x, w) - torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")).abs().max()
            gflops = 2 * m * n_in * n_out / mkl / 1e6
            print(f"{m:4d} {name:8} {mkl:8.3f} {onednn:10.3f} {onednn / mkl:6.2f} {gflops:11.0f} {diff.item():10.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=242)
    ap.add_argument("--rows", default="1,32", help="comma-separated M values for the linears")
    args = ap.parse_args()
    if args.context < 1:
        ap.error("--context must be positive")
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    if any(r < 1 for r in rows):
        ap.error("--rows values must be positive")
    attention(args.context)
    linears(rows)


if __name__ == "__main__":
    main()
