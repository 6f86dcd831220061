"""Decode steps with the streamed weights in huge pages (what the runner does on CPU, llmopt/core/huge_pages.py)
against the same checkpoint with its weights left in the pages they were loaded into: two engines in one
process, their generations alternating, so the VM's swings hit both alike. Prints ms per engine step.

    python scripts/bench_weight_pages.py /work/bench/awq135 --prompt-len 8 --rounds 6
    python scripts/bench_weight_pages.py default --prompt-len 8 --rounds 3
"""

from __future__ import annotations

import argparse
import time

import torch

import llmopt.runtime.model_runner as model_runner
from llmopt.core.memory import reuse_freed_memory
from llmopt.core.source import resolve
from llmopt.loader import load
from llmopt.runtime import SamplingParams
from llmopt.runtime.config import EngineConfig
from llmopt.runtime.engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="model spec")
    parser.add_argument("--prompt-len", type=int, default=8, help="prompt tokens before the 128 timed steps")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if min(args.prompt_len, args.rounds, args.threads) < 1:
        parser.error("--prompt-len, --rounds and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    reuse_freed_memory()  # as the CLI does
    config = EngineConfig(max_num_seqs=1, enable_prefix_caching=False)
    move = model_runner.move_streamed_weights
    model_runner.move_streamed_weights = lambda model: 0
    engines = {"4 KiB pages (as loaded)": LLMEngine(load(resolve(args.model)), config)}
    model_runner.move_streamed_weights = move
    engines["huge pages"] = LLMEngine(load(resolve(args.model)), config)
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)

    def step_ms(engine: LLMEngine, request_id: str) -> float:
        engine.add_request(list(range(100, 100 + args.prompt_len)), params, request_id=request_id)
        engine.step()  # the prompt
        steps, start = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        return (time.perf_counter() - start) / steps * 1e3

    for name, engine in engines.items():
        step_ms(engine, "warm-up")
    times: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, engine in engines.items():
            times[name].append(step_ms(engine, f"round-{r}"))
    for name, ts in times.items():
        print(f"{name:24s} " + " / ".join(f"{t:.2f}" for t in ts) + f"  (mean {sum(ts) / len(ts):.2f} ms a step)")


if __name__ == "__main__":
    main()
