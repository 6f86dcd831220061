"""The CPU paged decode attention over a whole model's layers, as a decode step reads them: one K/V
pool per layer (so the pools, not one layer's, decide what stays in cache), blocks scattered
through each pool, every layer called in turn. Prints ms per step and the pools' bytes per second.

    python scripts/bench_paged_decode.py                         # llmopt's build, the default model's shape
    python scripts/bench_paged_decode.py --so OLD/llmopt_cpu_ops.so --so NEW/llmopt_cpu_ops.so
    python scripts/bench_paged_decode.py --pool-blocks 3000 --pages 4k,huge --evict-mb 128 --rounds 12
    python scripts/bench_paged_decode.py --pool-blocks 3000 --dtype bfloat16   # a 16-bit pool (--kv-cache-dtype)
    python scripts/bench_paged_decode.py --layers 1 --threads 1 --isa avx2,avx512   # one layer's pools in cache

`--pool-blocks N` puts each step's blocks at random places in pools of the runtime's shape
(`[layers, N * block size, kv heads, head dim]`, one for K and one for V) instead, in 4 KiB pages
(`np.zeros`) and/or the runtime's huge-page pool (`model_runner.zeroed`) — `--pages` — timed in
alternating order; `--evict-mb` reads that much other memory before each step, as a model's weights
would evict the pools. `--so` loads other builds of the kernels (an older commit's, from its cache folder
`$LLMOPT_CACHE/torch_extensions/<digest>/`) to compare side by side in one process, in turn,
`--rounds` times. `llmopt bench kernels --kernels paged_decode` times one layer with flushed caches
against the PyTorch path; this script times the pattern a model's step makes.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import time
from pathlib import Path

import numpy as np
import torch


def load_build(path: str):
    """A compiled kernels module from its .so, as a module of its own: under the file stem alone a
    second build of the same name came back as the first one's module (CPython keeps extension
    modules by name), so every --so timed the first build; a package prefix named after the path
    keeps them apart (the init function is found by the last component)."""
    import torch  # noqa: F401 (the builds link against torch's libraries, loaded by importing it)

    prefix = "llmopt_build_" + hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(f"{prefix}.{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    parser.add_argument("--pool-blocks", type=int, default=0, help="blocks per pool of the runtime's shape (0: a "
                        "small pool per layer)")
    parser.add_argument("--pages", default="huge", help="with --pool-blocks: 4k and/or huge (comma-separated)")
    parser.add_argument("--evict-mb", type=int, default=0, help="MB of other memory read before each step")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the pools' element type "
                        "(`--kv-cache-dtype`)")
    parser.add_argument("--isa", default="", help="comma-separated SIMD paths to cap each build at in turn "
                        "(avx2, avx512: `LLMOPT_CPU_ISA`'s names; default: the widest the CPU has)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    heads, kv_heads, head_dim = (int(v) for v in args.heads.split(","))
    isas = [v for v in args.isa.split(",") if v]
    if any(v not in ("avx2", "avx512") for v in isas):
        parser.error(f"--isa takes avx2 and/or avx512, not {args.isa!r}")
    isas = isas or [""]  # "": the build's own choice
    if args.so:
        builds = [(path, load_build(path)) for path in args.so]
    else:
        from llmopt.kernels.cpu_extension import cpu_ops

        ops = cpu_ops()
        if ops is None:
            parser.error("llmopt's CPU kernels could not be built here")
        builds = [("llmopt", ops)]
    torch.manual_seed(0)
    evict = torch.randn(args.evict_mb << 18) if args.evict_mb else None
    shape = (args.layers, args.pool_blocks * args.block_size, kv_heads, head_dim)
    dtype = DTYPES[args.dtype]
    big_pools = {pages: (_pool(shape, pages, dtype), _pool(shape, pages, dtype)) for pages in args.pages.split(",")} \
        if args.pool_blocks else {}
    for batch in (int(v) for v in args.batch.split(",")):
        blocks_per_seq = -(-args.context // args.block_size)
        if big_pools:
            if blocks_per_seq * batch > args.pool_blocks:
                parser.error(f"--pool-blocks {args.pool_blocks} cannot hold {batch} x {args.context} tokens")
            tables = torch.randperm(args.pool_blocks)[: blocks_per_seq * batch].view(batch, blocks_per_seq)
            layouts = {pages: [(k[layer], v[layer]) for layer in range(args.layers)]
                       for pages, (k, v) in big_pools.items()}
        else:
            num_blocks = blocks_per_seq * batch
            tables = torch.randperm(num_blocks).view(batch, blocks_per_seq)
            layouts = {"": [(torch.randn(num_blocks * args.block_size, kv_heads, head_dim).to(dtype),
                             torch.randn(num_blocks * args.block_size, kv_heads, head_dim).to(dtype))
                            for _ in range(args.layers)]}
        q = torch.randn(batch, heads, head_dim)
        lens = torch.full((batch,), args.context)
        step_bytes = batch * args.context * kv_heads * head_dim * dtype.itemsize * 2 * args.layers
        iters = max(4, 40 // batch)
        cases = [(name, ops, pages, pools, isa) for name, ops in builds for pages, pools in layouts.items()
                 for isa in isas]
        for round_ in range(args.rounds):
            for name, ops, pages, pools, isa in cases if round_ % 2 == 0 else cases[::-1]:
                def step() -> None:
                    for k_cache, v_cache in pools:
                        ops.paged_decode(q, k_cache, v_cache, tables, lens, args.block_size, head_dim ** -0.5, 0)

                previous = ops.set_cpu_isa(isa) if isa else None
                try:
                    for _ in range(3):
                        step()
                    seconds = 0.0
                    for _ in range(iters):
                        if evict is not None:
                            evict.sum()
                        start = time.perf_counter()
                        step()
                        seconds += time.perf_counter() - start
                finally:
                    if previous is not None:
                        ops.set_cpu_isa(previous)
                seconds /= iters
                print(f"{name}{f' ({pages} pages)' if pages else ''}{f' [{isa}]' if isa else ''}: batch {batch} x "
                      f"{args.context} tokens, {args.layers} layers: {seconds * 1e3:.2f} ms per step, "
                      f"{step_bytes / seconds / 1e9:.1f} GB/s")


def _pool(shape: tuple[int, ...], pages: str, dtype: torch.dtype) -> torch.Tensor:
    """A K or V pool of `shape` and `dtype` in 4 KiB pages (`4k`) or as the runtime allocates it (`huge`), filled."""
    if pages == "4k":
        pool = torch.from_numpy(np.zeros(shape, dtype=np.float32)).to(dtype)
    elif pages == "huge":
        from llmopt.runtime.model_runner import zeroed

        pool = zeroed(shape, dtype, torch.device("cpu"))
    else:
        raise SystemExit(f"--pages takes 4k and/or huge, not {pages!r}")
    return pool.normal_()

if __name__ == "__main__":
    main()
