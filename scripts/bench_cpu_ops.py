#!/usr/bin/env python
"""Micro-benchmarks behind the runtime notes in docs/benchmarks.md (fp32, CPU, this machine's threads).

1. Decode attention, one layer call: the C++ kernel (`llmopt.kernels.cpu_paged_attention`)
   vs the PyTorch path (gather the blocks, then SDPA), at the default model's shape
   (9 query heads, 3 KV heads, head dim 64), 32 sequences x --context tokens, blocks
   scattered through a 3,200-block pool. The same K/V is reused call after call, so it
   sits in cache: an upper bound on what the kernel gains inside the model.
2. The default model's linears at M rows (qkv 576->960, o 576->576, gate_up 576->3072,
   down 1536->576 in each of 30 layers, weights streamed from memory as in a decode step;
   lm_head 576->49152): MKL (`F.linear`, what transformers runs), a oneDNN-packed weight,
   our skinny kernel (`llmopt.kernels.cpu_linear`), and the int4 kernel
   (`llmopt.kernels.cpu_int4`, the same weights RTN-quantized to 4 bits in groups of 64; its
   "max |diff|" column is mostly that quantization), and int8 (Q8_0) and bf16 copies of the
   weights (what int4 models' vocabulary projection may run on); a 2048^3 GEMM for the machine's
   large-GEMM rate.

    python scripts/bench_cpu_ops.py [--context 242] [--rows 1,4,16,32,64] [--layers 30]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.nn.functional as F

from llmopt.kernels.cpu_int4 import int4_linear_kernel, int8_linear_kernel, repack_int4, repack_int8
from llmopt.kernels.cpu_linear import skinny_linear_kernel
from llmopt.kernels.cpu_paged_attention import decode_kernel
from llmopt.kernels.paged_attention import decode_mask, paged_decode_attention
from llmopt.quant.quantizer import QuantScheme, quantize_rtn

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


def linears(rows: list[int], num_layers: int) -> None:
    """One decode step's linears, streaming `num_layers` layers of weights (as the model does),
    and the vocabulary projection, through each back end."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(2048, 2048, generator=gen), torch.randn(2048, 2048, generator=gen)
    ms = per_call_ms(lambda: a @ b)
    print(f"\nlarge GEMM 2048^3: {2 * 2048 ** 3 / ms / 1e6:.0f} GFLOPS")
    layer_shapes = [shape for name, shape in LINEARS.items() if name != "lm_head"]
    weights = [[torch.randn(n_out, n_in, generator=gen) * 0.05 for n_in, n_out in layer_shapes]
               for _ in range(num_layers)]
    lm_head = torch.randn(LINEARS["lm_head"][1], LINEARS["lm_head"][0], generator=gen) * 0.05
    skinny = skinny_linear_kernel()
    backends: dict[str, Callable] = {"MKL": F.linear}
    packed = {id(w): w.to_mkldnn() for w in [lm_head, *(w for layer in weights for w in layer)]}
    backends["oneDNN"] = lambda x, w: torch.ops.mkldnn._linear_pointwise(x, packed[id(w)], None, "none", [], "")
    if skinny is not None:
        backends["skinny"] = skinny
    int4 = int4_linear_kernel()
    if int4 is not None:
        int4_packed = {}
        for w in [lm_head, *(w for layer in weights for w in layer)]:
            q = quantize_rtn(w, QuantScheme(group_size=64))
            int4_packed[id(w)] = repack_int4(q.codes, q.scales, q.zeros, q.g_idx)

        def int4_fn(x, w):
            p = int4_packed[id(w)]
            return int4(x, p.codes, p.scales, p.scaled_zeros, p.out_features, p.group_size)

        backends["int4"] = int4_fn
    int8 = int8_linear_kernel()
    if int8 is not None:  # the copies int4 models use for the vocabulary projection (DenseLinear.use_compact_copy)
        int8_packed = {id(w): repack_int8(w) for w in [lm_head, *(w for layer in weights for w in layer)]}
        backends["int8"] = lambda x, w: int8(x, int8_packed[id(w)].codes, int8_packed[id(w)].scales, w.shape[0])
    if skinny is not None:
        bf16_copies = {id(w): w.to(torch.bfloat16) for w in [lm_head, *(w for layer in weights for w in layer)]}
        backends["bf16"] = lambda x, w: skinny(x, bf16_copies[id(w)])
    flops_per_row = 2 * num_layers * sum(n_in * n_out for n_in, n_out in layer_shapes)
    print(f"\n{num_layers} layers' linears ({sum(w.numel() for layer in weights for w in layer) * 4 / 2**20:.0f} MiB "
          f"of weights, streamed) and the vocabulary projection, per step:")
    print(f"{'M':>4} {'back end':8} {'layers ms':>10} {'GFLOPS':>7} {'lm_head ms':>11} {'max |diff| vs MKL':>18}")
    for m in rows:
        xs = {n_in: torch.randn(m, n_in, generator=gen) for n_in, _ in layer_shapes}
        for name, fn in backends.items():
            def step(fn=fn):
                for layer in weights:
                    for w in layer:
                        fn(xs[w.shape[1]], w)
            layers_ms = per_call_ms(step, min_seconds=1.0)
            head_ms = per_call_ms(lambda fn=fn: fn(xs[576], lm_head))
            diff = max((fn(xs[w.shape[1]], w) - F.linear(xs[w.shape[1]], w)).abs().max().item()
                       for w in [*weights[0], lm_head])
            print(f"{m:4d} {name:8} {layers_ms:10.1f} {m * flops_per_row / layers_ms / 1e6:7.0f} {head_ms:11.2f} "
                  f"{diff:18.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=242)
    ap.add_argument("--rows", default="1,4,16,32,64", help="comma-separated M values for the linears")
    ap.add_argument("--layers", type=int, default=30, help="layers of weights to stream (the default model has 30)")
    args = ap.parse_args()
    if args.context < 1 or args.layers < 1:
        ap.error("--context and --layers must be positive")
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    if any(r < 1 for r in rows):
        ap.error("--rows values must be positive")
    attention(args.context)
    linears(rows, args.layers)


if __name__ == "__main__":
    main()
