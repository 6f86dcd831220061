#!/usr/bin/env python
"""Benchmark the paged runtime against transformers, side by side in one run.

1. Throughput: N chat requests (output lengths uniform in [min, max], EOS ignored), all
   submitted at once. llmopt's runtime with --max-num-seqs vs transformers `generate`
   (a) one request at a time (on the first --sequential-requests of them: its rate does
   not depend on how many) and (b) in static padded batches of --batch-size.
2. Prefix caching: 32 requests sharing a ~1,000-token system prompt; mean TTFT with and
   without prefix caching, and the hit rate.
3. KV memory: peak KV bytes in use vs what pre-allocating max length per request needs.
With --extra-model SPEC (an AWQ / GPTQ folder, say), the throughput workload also runs on
that checkpoint, side by side with the fp32 default model; --skip-hf leaves out transformers.

Usage: python scripts/bench_runtime.py [--num-requests 64] [--extra-model DIR] [--skip-hf] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_baselines import BenchRequest, load_hf_model, make_chat_workload, run_hf_sequential, run_hf_static_batches  # noqa: E402

from llmopt.core import load  # noqa: E402
from llmopt.runtime import SamplingParams  # noqa: E402
from llmopt.runtime.llm import LLM  # noqa: E402
from llmopt.runtime.model_runner import kv_bytes_per_block  # noqa: E402

SYSTEM_PARAGRAPH = (
    "You are the support assistant of a company that rents out bicycles, scooters and small electric cars in "
    "twelve European cities. Answer politely and briefly, never promise refunds yourself, and always point "
    "customers to the self-service page for invoices, damage reports and lost items. Opening hours are eight "
    "in the morning to eight in the evening on weekdays and ten to six at weekends. "
)
QUESTIONS = ["How do I report a flat tyre?", "Can I rent a car for a week?", "Where do I find my invoice?",
             "Are helmets included?", "What happens if I return a scooter late?", "Do you have child seats?",
             "Can I pay in cash?", "Is there a student discount?"]


def run_llmopt(loaded, requests: list[BenchRequest], **config) -> dict:
    llm = LLM(loaded, **config)
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([requests[0].prompt_token_ids], warm)  # first-call overheads out of the timing
    llm.engine.kv.reset_prefix_cache()
    llm.engine.kv.peak_used_blocks = 0
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], params)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(r.max_tokens for r in requests), "every request must produce exactly max_tokens"
    ttft = [o.metrics.time_to_first_token for o in outs]
    stats = llm.engine.stats()
    return {
        "wall_s": wall, "output_tokens": tokens, "output_tok_per_s": tokens / wall,
        "mean_ttft_s": sum(ttft) / len(ttft), "stats": stats, "engine": llm.engine,
        "outputs": [o.outputs[0].token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--sequential-requests", type=int, default=8)
    ap.add_argument("--prefix-requests", type=int, default=32)
    ap.add_argument("--extra-model", action="append", default=[],
                    help="also run the throughput workload on this spec (e.g. an AWQ folder); repeatable")
    ap.add_argument("--skip-hf", action="store_true", help="skip the transformers baselines")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-prefix", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    loaded = load("default", dtype="float32")
    encode_chat = loaded.tokenizer.encode_chat
    report: dict = {"threads": torch.get_num_threads()}

    if not args.skip_throughput:
        requests = make_chat_workload(encode_chat, args.num_requests, args.min_output, args.max_output, args.seed)
        ours = run_llmopt(loaded, requests, max_num_seqs=args.max_num_seqs)
        extras = [(spec, run_llmopt(load(spec, dtype="float32"), requests, max_num_seqs=args.max_num_seqs))
                  for spec in args.extra_model]
        if extras:
            print(f"\n## llmopt on other checkpoints: the same {args.num_requests} requests\n")
            print("| model | output tokens | wall (s) | output tok/s | vs llmopt fp32 |")
            print("|---|---|---|---|---|")
            print(f"| default (fp32) | {ours['output_tokens']} | {ours['wall_s']:.1f} | {ours['output_tok_per_s']:.1f} | 1.00x |")
            for spec, run in extras:
                print(f"| {spec} | {run['output_tokens']} | {run['wall_s']:.1f} | {run['output_tok_per_s']:.1f} | "
                      f"{run['output_tok_per_s'] / ours['output_tok_per_s']:.2f}x |")
            report["extra_models"] = {spec: run["output_tok_per_s"] for spec, run in extras}
    if not args.skip_throughput and not args.skip_hf:
        hf = load_hf_model(loaded.source.path)
        seq = run_hf_sequential(hf, requests[: args.sequential_requests])
        static = run_hf_static_batches(hf, requests, args.batch_size, pad_token_id=2)
        # exactness spot check: greedy outputs agree with transformers one at a time
        agree = sum(a == b for a, b in zip(ours["outputs"], seq.outputs))
        block_bytes = kv_bytes_per_block(loaded.model, ours["engine"].config.block_size, loaded.dtype)
        per_token = block_bytes // ours["engine"].config.block_size
        peak_kv = ours["stats"].peak_kv_blocks_used * block_bytes
        max_len = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
        prealloc_workload = args.max_num_seqs * max_len * per_token
        prealloc_model = args.max_num_seqs * loaded.config.max_position_embeddings * per_token
        rows = [
            ("llmopt runtime", args.num_requests, ours["output_tokens"], ours["wall_s"], ours["output_tok_per_s"]),
            ("transformers, one at a time", seq.num_requests, seq.output_tokens, seq.wall_s, seq.output_tok_per_s),
            (f"transformers, static batches of {args.batch_size}", static.num_requests, static.output_tokens,
             static.wall_s, static.output_tok_per_s),
        ]
        print(f"\n## Throughput: {args.num_requests} chat requests, output {args.min_output}-{args.max_output} "
              f"tokens (EOS ignored), all at once, --max-num-seqs {args.max_num_seqs}, fp32, "
              f"{torch.get_num_threads()} threads\n")
        print("| engine | requests | output tokens | wall (s) | output tok/s | llmopt speed-up |")
        print("|---|---|---|---|---|---|")
        for name, n, tok, wall, rate in rows:
            print(f"| {name} | {n} | {tok} | {wall:.1f} | {rate:.1f} | {ours['output_tok_per_s'] / rate:.2f}x |")
        print(f"\ngreedy outputs identical to transformers one-at-a-time: {agree}/{len(seq.outputs)}")
        print(f"\nKV memory: peak in use {peak_kv / 2**20:.1f} MiB; pre-allocating per request for "
              f"{args.max_num_seqs} requests x {max_len} tokens (this workload's longest) = "
              f"{prealloc_workload / 2**20:.1f} MiB (ratio {peak_kv / prealloc_workload:.2f}); x "
              f"{loaded.config.max_position_embeddings} (the model's context) = {prealloc_model / 2**20:.0f} MiB "
              f"(ratio {peak_kv / prealloc_model:.3f})")
        report["throughput"] = {
            "llmopt_tok_per_s": ours["output_tok_per_s"], "hf_sequential_tok_per_s": seq.output_tok_per_s,
            "hf_static_tok_per_s": static.output_tok_per_s,
            "speedup_vs_sequential": ours["output_tok_per_s"] / seq.output_tok_per_s,
            "speedup_vs_static": ours["output_tok_per_s"] / static.output_tok_per_s,
            "llmopt_mean_ttft_s": ours["mean_ttft_s"], "greedy_agreement": [agree, len(seq.outputs)],
            "peak_kv_bytes": peak_kv, "prealloc_workload_bytes": prealloc_workload,
            "prealloc_model_len_bytes": prealloc_model, "preemptions": ours["stats"].num_preemptions,
        }

    if not args.skip_prefix:
        system = SYSTEM_PARAGRAPH * 12
        prompts = [encode_chat([{"role": "system", "content": system},
                                {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" (ticket {i})"}])
                   for i in range(args.prefix_requests)]
        requests = [BenchRequest(p, 16) for p in prompts]
        on = run_llmopt(loaded, requests, max_num_seqs=args.max_num_seqs, enable_prefix_caching=True)
        off = run_llmopt(loaded, requests, max_num_seqs=args.max_num_seqs, enable_prefix_caching=False)
        hit_rate = on["stats"].prefix_cache_hits / max(on["stats"].prefix_cache_queries, 1)
        print(f"\n## Prefix caching: {args.prefix_requests} requests sharing a {len(prompts[0]) - 20}-token "
              f"system prompt (prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens), 16 output tokens\n")
        print("| prefix caching | mean TTFT (s) | wall (s) | hit rate |")
        print("|---|---|---|---|")
        print(f"| on | {on['mean_ttft_s']:.2f} | {on['wall_s']:.1f} | {hit_rate:.1%} |")
        print(f"| off | {off['mean_ttft_s']:.2f} | {off['wall_s']:.1f} | - |")
        print(f"\nmean TTFT with / without = {on['mean_ttft_s'] / off['mean_ttft_s']:.3f} (target <= 0.333)")
        report["prefix_caching"] = {"mean_ttft_on_s": on["mean_ttft_s"], "mean_ttft_off_s": off["mean_ttft_s"],
                                    "ratio": on["mean_ttft_s"] / off["mean_ttft_s"], "hit_rate": hit_rate}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
