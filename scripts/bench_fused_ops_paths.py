"""`silu_and_mul` (the fused C++ op, `csrc/fused_ops.cpp`) on its AVX2 and AVX-512 paths side by side, fp32 and bf16
rows of the default model's width, in turn `--rounds` times: ms per call, and whether the paths agree bitwise.

    python scripts/bench_fused_ops_paths.py --rows 512
"""

from __future__ import annotations

import argparse
import time

import torch

from llmopt.kernels.cpu_extension import cpu_ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    ops = cpu_ops()
    if ops is None or ops.cpu_isa_supported() not in ("avx512", "amx"):
        raise SystemExit("needs the CPU kernels' AVX-512 path (this CPU or build lacks it)")
    torch.set_num_threads(args.threads)
    previous = ops.cpu_isa()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(args.rows, 2 * args.intermediate, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
            outs, cells = {}, []
            for _ in range(args.rounds):
                for path in ("avx2", "avx512"):
                    ops.set_cpu_isa(path)
                    outs[path] = ops.silu_and_mul(x)
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        ops.silu_and_mul(x)
                    cells.append(f"{path} {(time.perf_counter() - start) / args.calls * 1e3:.3f} ms")
            same = torch.equal(outs["avx2"], outs["avx512"])
            print(f"silu_and_mul {args.rows} x {args.intermediate} {dtype}: {', '.join(cells)}; bitwise equal: {same}")
    finally:
        ops.set_cpu_isa(previous)


if __name__ == "__main__":
    main()
