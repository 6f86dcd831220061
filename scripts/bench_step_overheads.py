"""Where a CPU decode step's time goes outside its kernels, and why the small torch ops around them cost
more than they do alone.

1. A decode step split (one engine, `--steps` steps of `--batch` sequences after a `--context`-token prompt,
   wall time of wrappers around the runner's calls): the decode plan's call (`run_decode_plan`: the embedding
   row, rope's cos/sin, the C++ layers, the final norm), the vocabulary projection (`compute_logits`), the
   rest of `execute` (building the step's tensors), and the rest of the step (scheduling, sampling, outputs).
2. The model's small ops of a step (the embedding row, rope's cos/sin, the final norm; batch 1) in a loop
   alone, and each right after a sum over `--evict-mb` MB (what a step's weight streaming does to their code
   and data in the caches).

    python scripts/bench_step_overheads.py /work/bench/awq135
    python scripts/bench_step_overheads.py /work/bench/awq135 --batch 8 --context 512
"""

from __future__ import annotations

import argparse
import time

import torch

from llmopt.loader import load
from llmopt.runtime import SamplingParams
from llmopt.runtime.config import EngineConfig
from llmopt.runtime.engine import LLMEngine
import llmopt.runtime.model_runner as model_runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="model spec (an int4 folder runs the int4 kernels and the int8 head)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--evict-mb", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if min(args.batch, args.context, args.steps, args.evict_mb, args.threads) < 1:
        parser.error("--batch, --context, --steps, --evict-mb and --threads must be positive")
    torch.set_num_threads(args.threads)
    loaded = load(args.model)
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=args.batch, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=args.steps + 10, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    for i in range(args.batch):
        prompt = torch.randint(100, vocab - 100, (args.context,), generator=gen).tolist()
        engine.add_request(prompt, params, request_id=str(i))
    for _ in range(5):
        engine.step()
    if engine.runner.decode_plan is None:
        parser.error(f"{args.model}: its decode steps do not run through the C++ plan on this machine")

    spent: dict[str, float] = {}

    def timed(owner, name: str, key: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - start

        setattr(owner, name, wrapper)

    runner = engine.runner
    timed(model_runner, "run_decode_plan", "plan")
    timed(runner.model, "compute_logits", "vocabulary projection")
    timed(runner, "execute", "execute")
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step = (time.perf_counter() - start) / args.steps
    per = {k: v / args.steps for k, v in spent.items()}
    rest_of_execute = per["execute"] - per["plan"] - per["vocabulary projection"]
    print(f"batch {args.batch}, ~{args.context} tokens of context, {args.steps} steps: step {step * 1e3:.3f} ms = "
          f"decode plan call {per['plan'] * 1e3:.3f} + vocabulary projection {per['vocabulary projection'] * 1e3:.3f}"
          f" + rest of execute {rest_of_execute * 1e3:.3f} + the rest of the step "
          f"{(step - per['execute']) * 1e3:.3f} ms")

    model = loaded.model.model
    ids, positions = torch.tensor([123]), torch.tensor([40])
    other = torch.randn(args.evict_mb << 18)
    with torch.inference_mode():
        x = model.embed(ids)
        ops = {"embedding row": lambda: model.embed(ids), "rope cos/sin": lambda: model.rotary_emb(positions, x.dtype),
               "final norm": lambda: model.norm(x)}
        for evict in (False, True):
            totals = dict.fromkeys(ops, 0.0)
            for _ in range(args.steps):
                if evict:
                    other.sum()
                for name, op in ops.items():
                    start = time.perf_counter()
                    op()
                    totals[name] += time.perf_counter() - start
            where = f"after a {args.evict_mb} MB sum" if evict else "alone, in a loop"
            print(f"small ops {where}: " + ", ".join(f"{k} {v / args.steps * 1e6:.1f} us" for k, v in totals.items()))


if __name__ == "__main__":
    main()
