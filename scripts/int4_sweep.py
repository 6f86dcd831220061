"""A GEMV / split-K configuration sweep of the Triton int4 kernel on Llama-3-8B's four projections
(groups of 128), M = 1..16, against fp16 cuBLAS: the tuning data one GPU run can give.

    python scripts/int4_sweep.py --output sweep.json [--rows 1-16] [--budget-s 90]

Each configuration (path, BLOCK_N, BLOCK_K, SPLIT_K, num_warps; `fused_matmul`'s `tune`) is
checked against the dense product once per shape and timed with `CallTimer` (cold cache, median)
at every M; the default dispatch (`int4_matmul`) and `F.linear` in fp16 are timed beside it.
Results go to the JSON file after every shape (a run cut off by its time budget keeps what it
measured); `best` lists the fastest configuration per (shape, M) with its speedup over cuBLAS.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

# ~46 compiles (a second each on a GPU host): the budget of one lent GPU, not an exhaustive search
GEMV_GRID = dict(BLOCK_N=(32, 64, 128), BLOCK_K=(128,), SPLIT_K=(1, 2, 4, 8, 16), num_warps=(2, 4))
SPLITK_GRID = dict(BLOCK_N=(64, 128), BLOCK_K=(64, 128), SPLIT_K=(2, 4, 8, 16), num_warps=(4,))
GEMV_MAX_ROWS = 4  # the GEMV reads the weight once per row: past a few rows it cannot win


def parse_rows(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(r) for r in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--rows", type=parse_rows, default=parse_rows("1-16"), help="M values: 1-16 or 1,2,4")
    parser.add_argument("--shapes", default="qkv,o,gate_up,down", help="Llama-3-8B projections to sweep")
    parser.add_argument("--budget-s", type=float, default=90.0, help="stop starting new shapes after this long")
    parser.add_argument("--num-iters", type=int, default=10, help="timed calls per figure")
    return parser


def configs(path: str) -> list[dict]:
    grid = GEMV_GRID if path == "gemv" else SPLITK_GRID
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    import torch
    import torch.nn.functional as F

    from llmopt.bench.kernel_timing import CallTimer
    from llmopt.bench.kernels_int4 import CUDA_GROUP_SIZE, LLAMA3_8B_SHAPES, random_int4
    from llmopt.kernels.triton_int4 import dequantize, int4_matmul, pack_int4
    from llmopt.kernels.triton_int4_kernels import fused_matmul

    device = torch.device("cuda")
    timer = CallTimer(device, warmup=2, iters=args.num_iters)
    document = {"device": torch.cuda.get_device_name(device), "group_size": CUDA_GROUP_SIZE, "rows": args.rows,
                "grids": {"gemv": GEMV_GRID, "splitk": SPLITK_GRID}, "results": [], "best": []}
    start = time.perf_counter()
    for name in args.shapes.split(","):
        if time.perf_counter() - start > args.budget_s:
            document.setdefault("skipped_shapes", []).append(name)
            continue
        n_in, n_out = LLAMA3_8B_SHAPES[name]
        packed = pack_int4(*random_int4(n_in, n_out, CUDA_GROUP_SIZE, device))
        w16 = dequantize(packed).half()
        x_all = torch.randn(max(args.rows), n_in, device=device, dtype=torch.float16)
        ref = x_all.float() @ w16.float().t()
        rows_of = {m: x_all[:m] for m in args.rows}
        for m in args.rows:
            x = rows_of[m]
            for label, fn in (("cublas fp16", lambda: F.linear(x, w16)), ("dispatch", lambda: int4_matmul(x, packed))):
                document["results"].append({"shape": name, "m": m, "config": label, "time_us": 1e6 * timer.median_call_s(fn)})
        for path in ("gemv", "splitk"):
            for tune in configs(path):
                record = {"shape": name, "path": path, **tune}
                try:
                    got = fused_matmul(x_all[:1], packed, None, path, tune)
                    record["max_rel_diff"] = float((got.float() - ref[:1]).abs().max() / ref[:1].abs().max())
                except Exception as e:  # noqa: BLE001  (a configuration that does not compile is data too)
                    document["results"].append({**record, "error": f"{type(e).__name__}: {e}"[:300]})
                    continue
                for m in args.rows:
                    if path == "gemv" and m > GEMV_MAX_ROWS:
                        continue
                    x = rows_of[m]
                    us = 1e6 * timer.median_call_s(lambda: fused_matmul(x, packed, None, path, tune))
                    document["results"].append({**record, "m": m, "config": path, "time_us": us})
        document["elapsed_s"] = time.perf_counter() - start
        _write(args.output, document)
    _write(args.output, document)
    print(json.dumps(document["best"], indent=1))


def _write(path: Path, document: dict) -> None:
    """The document with `best` recomputed: per (shape, M) the fastest int4 configuration."""
    timed = [r for r in document["results"] if "time_us" in r]
    best = []
    for key in sorted({(r["shape"], r["m"]) for r in timed}):
        rows = [r for r in timed if (r["shape"], r["m"]) == key]
        cublas = next((r["time_us"] for r in rows if r["config"] == "cublas fp16"), None)
        dispatch = next((r["time_us"] for r in rows if r["config"] == "dispatch"), None)
        swept = [r for r in rows if r["config"] in ("gemv", "splitk") and r.get("max_rel_diff", 1) < 1e-2]
        if swept and cublas:
            top = min(swept, key=lambda r: r["time_us"])
            best.append({"shape": key[0], "m": key[1], "best": {k: top[k] for k in top if k not in ("shape", "m")},
                         "speedup_vs_cublas": cublas / top["time_us"],
                         "dispatch_speedup_vs_cublas": cublas / dispatch if dispatch else None})
    document["best"] = best
    path.write_text(json.dumps(document, indent=1))


if __name__ == "__main__":
    main()
