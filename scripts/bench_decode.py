#!/usr/bin/env python
"""Batch-1 decode speed, side by side in one run: llmopt on each model spec given, and
llama-cpp-python on a GGUF file (default: the embedded Q4_1 file of the default model).

The same N chat prompts (hf_baselines.make_chat_workload, seed 0) go one request at a time
through each engine, greedy, EOS ignored, T new tokens each. Reported per engine: output
tokens/s over the wall time (prefill included) and decode tokens/s over the time after the
first token, with ratios to the first llmopt spec.

Usage: python scripts/bench_decode.py --model default --model /tmp/awq [--gguf FILE|none]
                                      [--num-prompts 8] [--max-tokens 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_baselines import make_chat_workload  # noqa: E402

from llmopt.core import load  # noqa: E402
from llmopt.core.embedded import default_gguf_path  # noqa: E402
from llmopt.runtime import SamplingParams  # noqa: E402
from llmopt.runtime.llm import LLM  # noqa: E402


def bench_llmopt(spec: str, prompts: list[list[int]], max_tokens: int, engine_args: dict) -> dict:
    llm = LLM(load(spec), max_num_seqs=1, **engine_args)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=8, temperature=0))  # warm-up
    wall = decode = 0.0
    tokens = 0
    outputs = []
    for ids in prompts:
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params)[0]
        elapsed = time.perf_counter() - start
        ttft = out.metrics.first_token_time - out.metrics.arrival_time
        wall += elapsed
        decode += elapsed - ttft
        tokens += len(out.outputs[0].token_ids)
        outputs.append(list(out.outputs[0].token_ids))
    return {"engine": f"llmopt {spec}", "output_tok_s": tokens / wall, "decode_tok_s": (tokens - len(prompts)) / decode,
            "tokens": tokens, "outputs": outputs}


def bench_llama_cpp(path: Path, prompts: list[list[int]], max_tokens: int, threads: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=1024, n_threads=threads, n_batch=512, verbose=False)

    def run(ids: list[int], n: int) -> tuple[list[int], float]:
        llm.reset()
        start = time.perf_counter()
        first = None
        got = []
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if first is None:
                first = time.perf_counter()
            got.append(token)
            if len(got) == n:
                break
        return got, first - start

    run(prompts[0], 8)  # warm-up
    wall = decode = 0.0
    tokens = 0
    outputs = []
    for ids in prompts:
        start = time.perf_counter()
        got, ttft = run(ids, max_tokens)
        elapsed = time.perf_counter() - start
        wall += elapsed
        decode += elapsed - ttft
        tokens += len(got)
        outputs.append(got)
    return {"engine": f"llama-cpp-python {llama_cpp.__version__} {path.name}", "output_tok_s": tokens / wall,
            "decode_tok_s": (tokens - len(prompts)) / decode, "tokens": tokens, "outputs": outputs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="llmopt model spec (repeatable); default: default")
    ap.add_argument("--gguf", default=None, help="GGUF file for llama-cpp-python (default: the embedded Q4_1; 'none' skips)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.num_prompts < 1 or args.max_tokens < 2:
        ap.error("--num-prompts must be >= 1 and --max-tokens >= 2")
    torch.set_num_threads(args.threads)
    specs = args.model or ["default"]
    tokenizer = load(specs[0]).tokenizer
    workload = make_chat_workload(tokenizer.encode_chat, args.num_prompts, args.max_tokens, args.max_tokens, seed=0)
    prompts = [r.prompt_token_ids for r in workload]
    results = [bench_llmopt(spec, prompts, args.max_tokens, {}) for spec in specs]
    if args.gguf != "none":
        gguf = Path(args.gguf) if args.gguf else default_gguf_path()
        try:
            results.append(bench_llama_cpp(gguf, prompts, args.max_tokens, args.threads))
        except ImportError as exc:
            print(f"llama-cpp-python skipped: {exc}", file=sys.stderr)
    base = results[0]["decode_tok_s"]
    print(f"{args.num_prompts} chat prompts x {args.max_tokens} new tokens, one at a time, greedy, EOS ignored, "
          f"{args.threads} threads")
    print(f"{'engine':60s} {'output tok/s':>13s} {'decode tok/s':>13s} {'ratio':>7s}")
    for r in results:
        print(f"{r['engine'][:60]:60s} {r['output_tok_s']:13.1f} {r['decode_tok_s']:13.1f} {r['decode_tok_s'] / base:7.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
