"""Write an lm-evaluation-harness task of bundled MMLU questions, for scoring through an endpoint offline.

    python scripts/lm_eval_mmlu_task.py OUT_DIR [--per-subject 3]

OUT_DIR gets `llmopt_mmlu.yaml` (task `llmopt_mmlu`, lm-eval's MMLU prompt: the subject line, the
question, four lettered choices, "Answer:", zero-shot) and `llmopt_mmlu.jsonl`: the first
`--per-subject` bundled questions of each of the 57 subjects (3: 171 questions). Then, e.g.:

    lm_eval --model local-completions --tasks llmopt_mmlu --include_path OUT_DIR \\
        --model_args base_url=http://127.0.0.1:8000/v1/completions,model=default,tokenizer=TOKENIZER_DIR,num_concurrent=4
"""

from __future__ import annotations

import argparse
from pathlib import Path

from llmopt.eval.metrics.mmlu import apply_limit, load_mmlu, write_lm_eval_task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--per-subject", type=int, default=3)
    args = parser.parse_args()
    questions = apply_limit(load_mmlu(None), args.per_subject)
    yaml = write_lm_eval_task(questions, args.out_dir)
    print(f"{len(questions)} questions -> {yaml}")


if __name__ == "__main__":
    main()
