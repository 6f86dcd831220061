#!/usr/bin/env python
"""Time and profile the runtime's steady-state decode steps (default: the default model).

32 chat requests run together; prints ms per step as their context grows, then the top
functions by own time (cProfile) over the last 40 steps.
Usage: python scripts/profile_decode_step.py [--model SPEC] [--num-seqs 32] [--top 10]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from llmopt.loader import load
from llmopt.runtime import SamplingParams
from llmopt.runtime.llm import LLM


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default", help="model spec (an AWQ / GPTQ folder runs the int4 kernel)")
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--top", type=int, default=10, help="functions to list from the profile")
    args = ap.parse_args()
    if args.num_seqs < 1 or args.top < 1:
        ap.error("--num-seqs and --top must be positive")
    engine = LLM(load(args.model, dtype="float32"), max_num_seqs=args.num_seqs).engine
    for i in range(args.num_seqs):
        engine.add_request([{"role": "user", "content": f"Tell me fact number {i} about the ocean."}],
                           SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
    engine.step()
    engine.step()  # the prompts
    profiler = cProfile.Profile()
    for phase in range(5):
        if phase == 4:
            profiler.enable()
        start = time.perf_counter()
        for _ in range(40):
            engine.step()
        per_step = (time.perf_counter() - start) / 40
        context = engine.scheduler.running[0].num_tokens
        print(f"context ~{context}: {per_step * 1e3:.1f} ms/step, {args.num_seqs / per_step:.0f} tok/s")
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
