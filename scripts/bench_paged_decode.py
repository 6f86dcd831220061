"""The CPU paged decode attention over a whole model's layers, as a decode step reads them: one K/V
pool per layer (so the pools, not one layer's, decide what stays in cache), blocks scattered
through each pool, every layer called in turn. Prints ms per step and the pools' bytes per second.

    python scripts/bench_paged_decode.py                         # llmopt's build, the default model's shape
    python scripts/bench_paged_decode.py --so OLD/llmopt_cpu_ops.so --so NEW/llmopt_cpu_ops.so

`--so` loads other builds of the kernels (an older commit's, from its cache folder
`$LLMOPT_CACHE/torch_extensions/<digest>/`) to compare side by side in one process, in turn,
`--rounds` times. `llmopt bench kernels --kernels paged_decode` times one layer with flushed caches
against the PyTorch path; this script times the pattern a model's step makes.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import torch


def load_build(path: str):
    """A compiled kernels module from its .so (module name = file stem)."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--so", action="append", default=[], help="a kernels build to time (repeatable)")
    parser.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--context", type=int, default=576, help="tokens per sequence")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", default="9,3,64", help="query heads, kv heads, head dim")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    heads, kv_heads, head_dim = (int(v) for v in args.heads.split(","))
    if args.so:
        builds = [(path, load_build(path)) for path in args.so]
    else:
        from llmopt.kernels.cpu_extension import cpu_ops

        ops = cpu_ops()
        if ops is None:
            parser.error("llmopt's CPU kernels could not be built here")
        builds = [("llmopt", ops)]
    torch.manual_seed(0)
    for batch in (int(v) for v in args.batch.split(",")):
        blocks_per_seq = -(-args.context // args.block_size)
        num_blocks = blocks_per_seq * batch
        pools = [(torch.randn(num_blocks * args.block_size, kv_heads, head_dim),
                  torch.randn(num_blocks * args.block_size, kv_heads, head_dim)) for _ in range(args.layers)]
        q = torch.randn(batch, heads, head_dim)
        tables = torch.randperm(num_blocks).view(batch, blocks_per_seq)
        lens = torch.full((batch,), args.context)
        step_bytes = batch * args.context * kv_heads * head_dim * 4 * 2 * args.layers
        iters = max(4, 40 // batch)
        for _ in range(args.rounds):
            for name, ops in builds:
                def step() -> None:
                    for k_cache, v_cache in pools:
                        ops.paged_decode(q, k_cache, v_cache, tables, lens, args.block_size, head_dim ** -0.5, 0)

                for _ in range(3):
                    step()
                start = time.perf_counter()
                for _ in range(iters):
                    step()
                seconds = (time.perf_counter() - start) / iters
                print(f"{name}: batch {batch} x {args.context} tokens, {args.layers} layers: "
                      f"{seconds * 1e3:.2f} ms per step, {step_bytes / seconds / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
