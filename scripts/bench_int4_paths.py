"""The C++ int4 kernel's SIMD paths side by side (`scalar`/`avx2`/`avx512`/`amx`, csrc/isa.h), on one
decoder layer of the default model (SmolLM2-135M: qkv, o, gate_up, down; groups of 64) per row count.

    python scripts/bench_int4_paths.py --threads 1 --rows 1,4,8,16,32,64,512
    python scripts/bench_int4_paths.py --threads 2 --rows 512 --so OLD/llmopt_cpu_ops.so --so NEW/llmopt_cpu_ops.so

Each path runs in turn within each repetition (so machine load hits them alike); the figure is the
fastest repetition's time per layer call, in the calling thread's CPU time with --threads 1 (robust
on a shared machine) or wall time otherwise, and the linears' tokens/s over 30 layers. It also
checks that every path's outputs are bitwise those of the AVX2 path. `--so` compares builds of the kernels
instead (an older commit's, from its cache folder `$LLMOPT_CACHE/torch_extensions/<digest>/`), each on its
widest path, and checks their outputs bitwise against the first build's.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from llmopt.kernels.cpu_extension import cpu_ops
from llmopt.kernels.cpu_int4 import repack_int4

from bench_paged_decode import load_build

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}  # (K, N)
PATHS = ["scalar", "avx2", "avx512", "amx"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,4,8,16,32,64,512")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--so", action="append", default=[], help="a kernels build to compare (repeatable)")
    args = parser.parse_args()
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("the CPU kernels could not be built here")
    torch.set_num_threads(args.threads)
    # what runs in turn: (label, kernels module, SIMD path to set or None)
    if args.so:
        # llmopt's own build is the module loaded above: its file loaded again would register its types twice
        runs = [(Path(path).parent.name, ops if Path(path).resolve() == Path(ops.__file__).resolve() else load_build(path),
                 None) for path in args.so]
    else:
        runs = [(path, ops, path) for path in PATHS[1: PATHS.index(ops.cpu_isa_supported()) + 1]]
    paths = [label for label, _, _ in runs]
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    gen = torch.Generator().manual_seed(0)
    packed = {}
    for name, (k, n) in SHAPES.items():
        groups = k // 64
        packed[name] = repack_int4(torch.randint(0, 16, (n, k), generator=gen), torch.rand(n, groups, generator=gen) + 0.5,
                                   torch.randint(0, 16, (n, groups), generator=gen), torch.arange(k) // 64)
    print(f"paths {paths}, {args.threads} thread(s), {'CPU' if args.threads == 1 else 'wall'} time")
    previous = ops.cpu_isa()
    try:
        for rows in [int(r) for r in args.rows.split(",")]:
            xs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}

            def layer(kernels) -> list[torch.Tensor]:
                return [kernels.int4_linear(xs[p.in_features], p.codes, p.scales, p.zeros, p.out_features,
                                            p.group_size, p.perm, None) for p in packed.values()]

            best, outs = {path: float("inf") for path in paths}, {}
            reps = max(1, 64 // rows)
            for _ in range(args.repeats):
                for label, kernels, isa in runs:
                    if isa is not None:
                        kernels.set_cpu_isa(isa)
                    outs[label] = layer(kernels)
                    start = clock()
                    for _ in range(reps):
                        layer(kernels)
                    best[label] = min(best[label], (clock() - start) / reps)
            same = all(torch.equal(a, b) for path in paths for a, b in zip(outs[path], outs[paths[0]]))
            cells = "  ".join(f"{path} {best[path] * 1e6:8.0f} us ({rows / best[path] / 30:6.0f} tok/s)" for path in paths)
            print(f"rows {rows:4d}: {cells}  bitwise equal: {same}", flush=True)
    finally:
        ops.set_cpu_isa(previous)


if __name__ == "__main__":
    main()
