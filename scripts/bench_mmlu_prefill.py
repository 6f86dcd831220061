"""MMLU's prefill as `llmopt eval` runs it (`loglikelihood.run_jobs` on the bundled questions), per model:
seconds with and without shared prefixes run once (alternating `--rounds` times), the part in attention,
and what sharing changes in the scores (mean / max |Δ log-likelihood| per choice, questions with the same
answer). `--text BASELINE,CANDIDATE` also times the ppl+KLD pass (`textscore.score_text`, 16 x 512 tokens of
the bundled text: the baseline storing its record, the candidate scoring KLD against it).

    python scripts/bench_mmlu_prefill.py default,/path/to/int4-model --every 5
    python scripts/bench_mmlu_prefill.py default --precision ieee --every 10
    python scripts/bench_mmlu_prefill.py default --text default,/path/to/int4-model
"""

from __future__ import annotations

import argparse
import time

import torch

from llmopt.core.source import resolve
from llmopt.eval.metrics import loglikelihood as ll
from llmopt.eval.metrics.mmlu import build_requests, load_mmlu
from llmopt.eval.metrics.text import bos_id, context_bos_id, load_text, tokenize
from llmopt.eval.metrics.textscore import score_text
from llmopt.loader import load

attention_s = [0.0]
_forward = ll.PackedAttention.forward


def _timed_forward(self, *args, **kwargs):
    start = time.perf_counter()
    out = _forward(self, *args, **kwargs)
    attention_s[0] += time.perf_counter() - start
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", help="comma-separated model specs")
    ap.add_argument("--every", type=int, default=5, help="every Nth bundled question")
    ap.add_argument("--precision", default="auto", help="--fp32-matmul-precision")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--text", help="BASELINE,CANDIDATE: also time the ppl+KLD pass")
    args = ap.parse_args()
    ll.PackedAttention.forward = _timed_forward
    questions = load_mmlu()[::args.every]
    pairs = [(r.context, c) for r in build_requests(questions) for c in r.continuations]
    for spec in args.models.split(","):
        loaded = load(resolve(spec))
        loaded.model.use_fp32_matmul_precision(args.precision)
        jobs, _ = ll.plan_jobs(loaded.tokenizer, pairs, loaded.config.max_position_embeddings,
                               context_bos_id(loaded.tokenizer, None))
        tokens = sum(len(j.ids) for j in jobs)
        shared_tokens = sum(u.num_tokens for u in ll.plan_units(jobs, ll.DEFAULT_BATCH_TOKENS))
        ll.run_jobs(loaded.model, jobs[:10], len(pairs))  # warm up
        scores = {}
        for _ in range(args.rounds):
            for label, min_shared in (("whole", None), ("shared prefixes", ll.MIN_SHARED_PREFIX)):
                attention_s[0] = 0.0
                start = time.perf_counter()
                scores[label] = torch.tensor(ll.run_jobs(loaded.model, jobs, len(pairs), min_shared_prefix=min_shared)[0])
                print(f"{spec} [{args.precision}] {label}: {len(questions)} questions, "
                      f"{tokens if min_shared is None else shared_tokens} tokens, {time.perf_counter() - start:.2f} s "
                      f"(attention {attention_s[0]:.2f} s)", flush=True)
        a, b = scores["whole"], scores["shared prefixes"]
        same = int((a.view(-1, 4).argmax(1) == b.view(-1, 4).argmax(1)).sum())
        print(f"{spec}: shared vs whole |Δ log-likelihood| mean {(a - b).abs().mean():.4f} max {(a - b).abs().max():.4f}, "
              f"same answer {same}/{len(questions)}", flush=True)
    if args.text:
        base_spec, cand_spec = args.text.split(",")
        base_model, cand_model = load(resolve(base_spec)), load(resolve(cand_spec))
        for m in (base_model, cand_model):
            m.model.use_fp32_matmul_precision(args.precision)
        ids = tokenize(base_model.tokenizer, load_text(None), 512, 16)
        bos = bos_id(base_model.tokenizer)
        start = time.perf_counter()
        base = score_text(base_model.model, ids, 512, bos_id=bos, store=True)
        middle = time.perf_counter()
        cand = score_text(cand_model.model, ids, 512, bos_id=bos, base=base)
        print(f"ppl+KLD pass, {len(ids)} tokens: baseline {middle - start:.2f} s, candidate "
              f"{time.perf_counter() - middle:.2f} s (KLD mean {cand.kld.mean:.6f})", flush=True)


if __name__ == "__main__":
    main()
