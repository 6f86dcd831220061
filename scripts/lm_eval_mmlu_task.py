"""Write an lm-evaluation-harness task of bundled MMLU questions, for scoring through an endpoint offline.

    python scripts/lm_eval_mmlu_task.py OUT_DIR [--per-subject 3]

OUT_DIR gets `llmopt_mmlu.yaml` (task `llmopt_mmlu`, lm-eval's MMLU prompt: the subject line, the
question, four lettered choices, "Answer:", zero-shot) and `questions.jsonl`: the first
`--per-subject` bundled questions of each of the 57 subjects (3: 171 questions). Then, e.g.:

    lm_eval --model local-completions --tasks llmopt_mmlu --include_path OUT_DIR \\
        --model_args base_url=http://127.0.0.1:8000/v1/completions,model=default,tokenizer=TOKENIZER_DIR,num_concurrent=4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llmopt.eval.metrics.mmlu import apply_limit, load_mmlu

TASK_YAML = """\
task: llmopt_mmlu
dataset_path: json
dataset_kwargs:
  data_files:
    test: {rows}
test_split: test
output_type: multiple_choice
description: "The following are multiple choice questions (with answers) about {{{{subject.replace('_', ' ')}}}}.\\n\\n"
doc_to_text: "{{{{question.strip()}}}}\\nA. {{{{choices[0]}}}}\\nB. {{{{choices[1]}}}}\\nC. {{{{choices[2]}}}}\\nD. {{{{choices[3]}}}}\\nAnswer:"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--per-subject", type=int, default=3)
    args = parser.parse_args()
    questions = apply_limit(load_mmlu(None), args.per_subject)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows = args.out_dir / "questions.jsonl"
    with rows.open("w") as f:
        for q in questions:
            f.write(json.dumps({"subject": q.subject, "question": q.question, "choices": list(q.choices),
                                "answer": q.answer}) + "\n")
    (args.out_dir / "llmopt_mmlu.yaml").write_text(TASK_YAML.format(rows=rows.resolve()))
    print(f"{len(questions)} questions -> {args.out_dir / 'llmopt_mmlu.yaml'}")


if __name__ == "__main__":
    main()
