"""A decode step's C++ part on CPU, side by side across builds of the kernels: every decoder
layer (`DecodePlan.run`, llmopt/runtime/cpu_decode_plan.py) and, for int4 models, the vocabulary
projection's int8 copy, each timed as a step runs them (weights from memory: a step reads more than
the caches hold). Prints ms per step per build.

    python scripts/bench_decode_plan.py /work/bench/awq135                    # llmopt's build
    python scripts/bench_decode_plan.py MODEL --so OLD/llmopt_cpu_ops.so --so NEW/llmopt_cpu_ops.so --rounds 5
    python scripts/bench_decode_plan.py MODEL --batch 8 --context 512 --so OLD/... --so NEW/...   # a batch of 8
    python scripts/bench_decode_plan.py llama-3.2-1b --load-format dummy --quantization awq ...   # real shapes

`--so` loads other builds (an older commit's, from its cache folder
`$LLMOPT_CACHE/torch_extensions/<digest>/`); the builds run in turn within each round, so the VM's
swings hit them alike. The sequence's context is `--context` tokens (a prompt of that length,
prefilled once by llmopt's own build; the plans then write and read the same KV slots); `--batch`
sequences of it decode together (different tokens each).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from llmopt.errors import LlmoptError
from llmopt.kernels.cpu_extension import cpu_ops
from llmopt.loader import load
from llmopt.runtime import SamplingParams
from llmopt.runtime.cpu_decode_plan import build_decode_plan
from llmopt.runtime.llm import LLM
import llmopt.runtime.model_runner as model_runner

from bench_paged_decode import load_build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="model spec (an AWQ / GPTQ folder: the int4 kernels)")
    parser.add_argument("--so", action="append", default=[], help="a kernels build to time (repeatable)")
    parser.add_argument("--context", type=int, default=64, help="tokens of context at the timed step")
    parser.add_argument("--batch", type=int, default=1, help="sequences in the timed step")
    parser.add_argument("--load-format", default="auto", help="'dummy': random weights of the model's shape")
    parser.add_argument("--quantization", default=None, help="with --load-format dummy: awq / gptq int4 weights")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per build per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.context < 2 or min(args.batch, args.steps, args.rounds, args.threads) < 1:
        parser.error("--context must be at least 2, --batch, --steps, --rounds and --threads at least 1")
    torch.set_num_threads(args.threads)
    try:
        loaded = load(args.model, dtype="float32", load_format=args.load_format, quantization=args.quantization)
    except LlmoptError as exc:
        parser.error(str(exc))
    llm = LLM(loaded, max_num_seqs=max(args.batch, 8))
    runner = llm.engine.runner
    if runner.decode_plan is None:
        parser.error(f"{args.model}: its decode steps do not run through the C++ plan on this machine")
    captured = {}
    run_plan = model_runner.run_decode_plan

    def capture(*call):  # the widest decode step's arguments: its tokens, slots, block tables
        if "call" not in captured or call[2].shape[0] > captured["call"][2].shape[0]:
            captured["call"] = call
        return run_plan(*call)

    model_runner.run_decode_plan = capture
    prompts = [[1 + (b * 7919 + i) % 30000 for i in range(args.context - 1)] for b in range(args.batch)]
    llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    model_runner.run_decode_plan = run_plan
    _, model, input_ids, positions, *rest = captured["call"]
    if input_ids.shape[0] != args.batch:
        parser.error(f"the engine decoded at most {input_ids.shape[0]} of the {args.batch} sequences at once "
                     "(its KV pool or batch limits)")
    print(f"{args.batch} sequence(s) at {positions.min().item() + 1}-{positions.max().item() + 1} tokens of context, "
          f"KV pool {runner.attn.k_caches.dtype}", flush=True)
    ops = cpu_ops()  # llmopt's build, loaded by the run above: its file again would register its types twice
    builds = [(path, ops if Path(path).resolve() == Path(ops.__file__).resolve() else load_build(path))
              for path in args.so] or [("llmopt", ops)]
    head = model.lm_head.int8_weight
    with torch.inference_mode():
        x = model.model.embed(input_ids)
        cos, sin = model.model.rotary_emb(positions, x.dtype)
        plans = {name: (build_decode_plan(model, runner.attn.k_caches.dtype, ops), ops) for name, ops in builds}
        hidden = torch.randn(args.batch, x.shape[1])
        for r in range(args.rounds):
            for name, (plan, ops) in plans.items():
                for _ in range(10):
                    plan.run(x, cos, sin, *rest)
                layers_s = head_s = 0.0
                for _ in range(args.steps):  # as a step runs them: the layers, then the head
                    start = time.perf_counter()
                    plan.run(x, cos, sin, *rest)
                    middle = time.perf_counter()
                    if head is not None:
                        ops.int8_linear(hidden, head.codes, head.scales, head.out_features)
                    head_s += time.perf_counter() - middle
                    layers_s += middle - start
                line = f"round {r + 1}  {name}: layers {layers_s / args.steps * 1e3:.3f} ms"
                if head is not None:
                    line += f", vocabulary projection (int8) {head_s / args.steps * 1e3:.3f} ms"
                print(line, flush=True)


if __name__ == "__main__":
    main()
