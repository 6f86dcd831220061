#!/usr/bin/env python
"""Measure how long loading the default model takes from a cold and a warm cache.

Each run is a fresh Python process (imports included), as a user's `llmopt` call is.
Usage: python scripts/bench_load.py [--runs 5] [--spec default]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, time
t0 = time.perf_counter()
from llmopt.loader import load
t1 = time.perf_counter()
m = load({spec!r}, dtype="float32")
t2 = time.perf_counter()
print(json.dumps({{"import_s": t1 - t0, "load_s": t2 - t1, "total_s": t2 - t0}}))
"""


def run_once(spec: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD.format(spec=spec)], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--spec", default="default")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "LLMOPT_CACHE": cache}
        cold = run_once(args.spec, env)
        warm = [run_once(args.spec, env) for _ in range(args.runs)]
    print("| cache | runs | import (s) | load() (s) | total (s) |")
    print("|---|---|---|---|---|")
    print(f"| cold (converts GGUF) | 1 | {cold['import_s']:.2f} | {cold['load_s']:.2f} | {cold['total_s']:.2f} |")
    med = {k: statistics.median(r[k] for r in warm) for k in warm[0]}
    worst = max(r["total_s"] for r in warm)
    print(f"| warm (median) | {args.runs} | {med['import_s']:.2f} | {med['load_s']:.2f} | {med['total_s']:.2f} (max {worst:.2f}) |")


if __name__ == "__main__":
    main()
