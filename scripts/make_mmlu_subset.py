#!/usr/bin/env python
"""Make the bundled offline MMLU subset: the same number of test questions from every subject.

How the shipped file was made (from the repository root):

    python scripts/make_mmlu_subset.py --test ../shared/data/mmlu/test.jsonl.gz

which reads the 14,042 cais/mmlu test questions and writes
llmopt/eval/data/mmlu_subset.jsonl.gz: 20 questions per subject (all of a subject's when
it has fewer), 57 subjects, 1,140 questions. Subjects are visited in alphabetical order with
one `random.Random(seed)`; each subject's picks keep their order in the source file (so
`--limit` takes the same questions lm-eval would take from that order). The output is
byte-for-byte reproducible (gzip without a timestamp).

If a dev split sits beside the test file (dev.jsonl.gz, the 5 few-shot examples per
subject), or --dev names one, it is copied whole into llmopt/eval/data/mmlu_dev.jsonl.gz so
the bundled subset can do few-shot. The shipped one (285 examples, 5 per subject in the original
order) was converted from the Hendrycks CSVs data/mmlu/dev/*_dev.csv (header question,
choice0..3, answer index) of the public repository HaeChan0305/MLILAB-FedLLM (commit d92730e),
whose data/mmlu/test/*.csv hold exactly the 14,042 questions of ../shared/data/mmlu/test.jsonl.gz,
then written with `--dev dev.jsonl.gz` (the test subset came out byte for byte the same).

MMLU (Hendrycks et al., 2021) is MIT-licensed; llmopt/eval/data/MMLU_LICENSE.txt carries
the notice and must ship with the data.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from llmopt.errors import LlmoptError  # noqa: E402
from llmopt.eval.metrics.mmlu import BUNDLED_DEV, BUNDLED_TEST, SUBJECTS, MMLUQuestion, load_mmlu  # noqa: E402


def stratified_subset(questions: list[MMLUQuestion], per_subject: int, seed: int) -> list[MMLUQuestion]:
    by_subject: dict[str, list[MMLUQuestion]] = {}
    for q in questions:
        by_subject.setdefault(q.subject, []).append(q)
    rng = random.Random(seed)
    subset: list[MMLUQuestion] = []
    for subject in sorted(by_subject):
        pool = by_subject[subject]
        picks = sorted(rng.sample(range(len(pool)), min(per_subject, len(pool))))
        subset.extend(pool[i] for i in picks)
    return subset


def write_jsonl_gz(questions: list[MMLUQuestion], path: Path) -> None:
    lines = [
        json.dumps({"subject": q.subject, "question": q.question, "choices": list(q.choices), "answer": q.answer},
                   ensure_ascii=False)
        for q in questions
    ]
    data = ("\n".join(lines) + "\n").encode("utf-8")
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as f:
        f.write(data)
    tmp.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--test", required=True, help="cais/mmlu test split (.jsonl/.jsonl.gz/.parquet/.json)")
    parser.add_argument("--dev", help="dev split to bundle whole (default: dev.* beside --test, if any)")
    parser.add_argument("--per-subject", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=Path, default=BUNDLED_TEST)
    args = parser.parse_args()

    questions = load_mmlu(args.test)
    subset = stratified_subset(questions, args.per_subject, args.seed)
    write_jsonl_gz(subset, args.out)
    counts = Counter(q.subject for q in subset)
    print(f"{args.out}: {len(subset)} questions from {len(questions)}, {len(counts)} subjects "
          f"({min(counts.values())}-{max(counts.values())} each), {args.out.stat().st_size} bytes")
    missing = sorted(set(SUBJECTS) - set(counts))
    if missing:
        print(f"warning: no questions for {', '.join(missing)}", file=sys.stderr)

    try:
        dev = load_mmlu(args.dev) if args.dev else load_mmlu(args.test, split="dev")
    except LlmoptError as e:
        print(f"no dev split bundled: {e}")
        return
    dev_out = args.out.with_name(BUNDLED_DEV.name)
    write_jsonl_gz(dev, dev_out)
    print(f"{dev_out}: {len(dev)} dev examples")


if __name__ == "__main__":
    main()
