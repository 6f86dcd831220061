"""Fidelity of quantized checkpoints: perplexity and KL divergence to the unquantized model.

Text: MMLU test questions (with their choices) from question --offset on, held out from
the calibration file scripts/autoawq_baseline.py makes (it takes questions from the start).

    python scripts/quant_fidelity.py --base default --cand /tmp/q/rtn --cand /tmp/q/awq --tokens 8192
"""

from __future__ import annotations

import argparse
import gzip
import json
import time

import torch

from llmopt.loader import load
from llmopt.eval.metrics.textscore import kl_divergence


def heldout_text(path: str, offset: int, max_chars: int) -> str:
    parts, size = [], 0
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i < offset:
                continue
            row = json.loads(line)
            choices = "\n".join(f"{'ABCD'[j]}. {c}" for j, c in enumerate(row["choices"]))
            parts.append(f"{row['question'].strip()}\n{choices}")
            size += len(parts[-1])
            if size > max_chars:
                break
    return "\n\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="default")
    ap.add_argument("--cand", action="append", required=True)
    ap.add_argument("--mmlu", default="../shared/data/mmlu/test.jsonl.gz")
    ap.add_argument("--offset", type=int, default=10000)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--ctx-size", type=int, default=512, help="llama.cpp's: non-overlapping chunks, second half scored")
    args = ap.parse_args()
    base = load(args.base)
    ids = torch.tensor(base.tokenizer.encode(heldout_text(args.mmlu, args.offset, args.tokens * 8), add_special_tokens=False)[: args.tokens])
    rows = []
    for cand_spec in args.cand:
        t0 = time.perf_counter()
        cand = load(cand_spec)
        r = kl_divergence(base.model, cand.model, ids, args.ctx_size)
        rows.append({"candidate": cand_spec, **{k: round(v, 5) if isinstance(v, float) else v for k, v in r.to_dict().items()
                                                if k != "delta_p"},
                     "seconds": round(time.perf_counter() - t0, 1)})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'candidate':40} {'ppl_base':>9} {'ppl':>9} {'KLD mean':>9} {'KLD p99':>9} {'same top':>9}")
    for r in rows:
        print(f"{r['candidate']:40} {r['ppl_base']:9.3f} {r['ppl_cand']:9.3f} {r['mean']:9.4f} {r['p99']:9.4f} {r['same_top_p']:9.3f}")


if __name__ == "__main__":
    main()
