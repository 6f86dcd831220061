"""Registers, spills and shared memory of every Triton kernel variant llmopt can launch, compiled
for NVIDIA GPUs on this machine (no GPU needed: Triton's compiler and ptxas run anywhere).

    python scripts/triton_compile_report.py                 # every constexpr value, sm_80/89/90
    python scripts/triton_compile_report.py --scope full --json report.json
    python scripts/triton_compile_report.py --scope full --kernel _rms_norm_kernel,_rotary_kernel

The variants are those tests/test_triton_compile.py compiles (`llmopt.kernels.triton_variants`).
Spills are Triton's `n_spills` (local memory per thread / 4 bytes); a decode-path kernel that spills
pays for it on every token. Prints one line per variant, then per kernel and target the variant
count, the most registers, the variants that spill and the most shared memory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

from llmopt.bench.kernel_variants import shipped_params
from llmopt.kernels.triton_variants import compile_tasks, compile_variants, enumerate_variants, select


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="80,89,90", help="compute capabilities, comma-separated")
    parser.add_argument("--scope", default="cover", choices=("smoke", "cover", "full"),
                        help="smoke: every dtype and flag; cover: every constexpr value too; full: all (hours)")
    parser.add_argument("--jobs", type=int, default=2, help="compiler processes")
    parser.add_argument("--kernel", help="only these kernels (names, comma-separated: e.g. _rotary_kernel)")
    parser.add_argument("--json", type=Path, help="also write every result here")
    args = parser.parse_args()
    archs = [int(a) for a in args.arch.split(",")]
    params = shipped_params()
    variants = enumerate_variants(params)
    chosen = select(variants, args.scope)
    if args.kernel:
        names = set(args.kernel.split(","))
        unknown = names - {v.kernel for v in variants}
        if unknown:
            parser.error(f"no such kernel: {', '.join(sorted(unknown))}")
        chosen = [v for v in chosen if v.kernel in names]
    tasks = compile_tasks(variants, chosen, archs)
    print(f"{len(chosen)} of {len(variants)} variants ({args.scope}), {len(tasks)} compiles for sm_"
          + "/".join(map(str, archs)) + " (fp8 pools from sm_89 on)", flush=True)
    start = time.perf_counter()
    results = compile_variants(params, tasks, jobs=args.jobs)
    wall = time.perf_counter() - start
    print(f"{'arch':>5} {'regs':>5} {'spills':>6} {'smem KiB':>8} {'warps':>5}  variant")
    for r in sorted(results, key=lambda r: (r.kernel, r.arch)):
        if r.ok:
            print(f"sm_{r.arch} {r.registers:5d} {r.spills:6d} {r.shared_bytes / 1024:8.1f} {r.num_warps:5d}  {r.label}")
        else:
            print(f"sm_{r.arch} FAILED  {r.label}\n    {r.error.splitlines()[0] if r.error else ''}")
    print("\nper kernel and target: variants, most registers, variants that spill, most shared memory")
    groups = defaultdict(list)
    for r in results:
        groups[(r.kernel, r.arch)].append(r)
    for (kernel, arch), rs in sorted(groups.items()):
        ok = [r for r in rs if r.ok]
        spilling = [r for r in ok if r.spills]
        print(f"  {kernel:22s} sm_{arch}: {len(rs):3d} variants, {len(rs) - len(ok)} failed, "
              f"max {max((r.registers for r in ok), default=0)} regs, {len(spilling)} spill"
              f"{f' (up to {max(r.spills for r in spilling)} words)' if spilling else ''}, "
              f"max {max((r.shared_bytes for r in ok), default=0) / 1024:.1f} KiB shared")
    failed = sum(not r.ok for r in results)
    print(f"\n{len(results)} compiles in {wall:.0f}s ({args.jobs} processes), {failed} failed, "
          f"{sum(bool(r.spills) for r in results if r.ok)} spill")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
