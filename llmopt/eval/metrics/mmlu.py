"""MMLU scored the way lm-evaluation-harness scores its `mmlu` task, so the numbers compare.

What we copy from lm-eval (v0.4, `lm_eval/tasks/mmlu/default`):

- Prompt: the subject's description "The following are multiple choice questions (with
  answers) about {subject, underscores as spaces}.\\n\\n", then k few-shot examples, then
  "{question.strip()}\\nA. {c0}\\nB. {c1}\\nC. {c2}\\nD. {c3}\\nAnswer:". A few-shot example is
  the same block followed by " {letter}\\n\\n" (target delimiter " ", fewshot delimiter "\\n\\n").
- Few-shot examples are the first k of the subject's dev split (`sampler: first_n`).
- Continuations " A", " B", " C", " D"; the prediction is the one with the highest
  log-likelihood (the first on ties, as numpy's argmax); acc is the mean of 0/1 correct.
- Per-subject stderr: lm-eval's `mean_stderr`, the sample stderr of the mean,
  sqrt(sum((x - mean)^2) / (n - 1)) / sqrt(n) = sqrt(p(1 - p) / (n - 1)) for 0/1 scores.
- The four category groups (stem, humanities, social_sciences, other) and the overall
  `mmlu`: acc weighted by document count (= the mean over all their questions); stderr is
  lm-eval's `pooled_sample_stderr`: subjects pooled into each group, then the four groups
  pooled into `mmlu`. That pooled variance leaves out the spread *between* subjects'
  means, so it is a little smaller than the stderr of all questions taken together; we keep
  it so that our figures and lm-eval's can be set side by side. Where a stderr is undefined
  (a subject with one question) it is None, and so is every group above it (lm-eval: "N/A").
- `limit` applies per subject, as lm-eval's `--limit` applies per task and every subject is
  a task: an integer keeps the first `limit` questions of each subject, a fraction < 1 keeps
  ceil(fraction * n) of them.

Data: `load_mmlu(None)` is the bundled stratified subset of the test split, and
`load_mmlu(None, "dev")` the whole dev split (see scripts/make_mmlu_subset.py and data/MMLU_LICENSE.txt), a path is a local file in the cais/mmlu schema, "hf:cais/mmlu[:config]"
goes through `datasets`. Scoring needs no model: the caller passes log-likelihoods, or a
function that computes them in one batch.
"""

from __future__ import annotations

import gzip
import json
import math
import numbers
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmopt.errors import LlmoptError
from llmopt.eval.gates import stats

# lm-eval's subject -> category map (lm_eval/tasks/mmlu/_generate_configs.py). Note that it
# files anatomy under stem, where Hendrycks et al.'s original grouping had it under other.
SUBJECTS: dict[str, str] = {
    "abstract_algebra": "stem", "anatomy": "stem", "astronomy": "stem",
    "business_ethics": "other", "clinical_knowledge": "other", "college_biology": "stem",
    "college_chemistry": "stem", "college_computer_science": "stem", "college_mathematics": "stem",
    "college_medicine": "other", "college_physics": "stem", "computer_security": "stem",
    "conceptual_physics": "stem", "econometrics": "social_sciences", "electrical_engineering": "stem",
    "elementary_mathematics": "stem", "formal_logic": "humanities", "global_facts": "other",
    "high_school_biology": "stem", "high_school_chemistry": "stem", "high_school_computer_science": "stem",
    "high_school_european_history": "humanities", "high_school_geography": "social_sciences",
    "high_school_government_and_politics": "social_sciences", "high_school_macroeconomics": "social_sciences",
    "high_school_mathematics": "stem", "high_school_microeconomics": "social_sciences",
    "high_school_physics": "stem", "high_school_psychology": "social_sciences", "high_school_statistics": "stem",
    "high_school_us_history": "humanities", "high_school_world_history": "humanities", "human_aging": "other",
    "human_sexuality": "social_sciences", "international_law": "humanities", "jurisprudence": "humanities",
    "logical_fallacies": "humanities", "machine_learning": "stem", "management": "other", "marketing": "other",
    "medical_genetics": "other", "miscellaneous": "other", "moral_disputes": "humanities",
    "moral_scenarios": "humanities", "nutrition": "other", "philosophy": "humanities", "prehistory": "humanities",
    "professional_accounting": "other", "professional_law": "humanities", "professional_medicine": "other",
    "professional_psychology": "social_sciences", "public_relations": "social_sciences",
    "security_studies": "social_sciences", "sociology": "social_sciences", "us_foreign_policy": "social_sciences",
    "virology": "other", "world_religions": "humanities",
}
GROUPS = ("stem", "humanities", "social_sciences", "other")  # lm-eval's order in `_mmlu.yaml`
LETTERS = ("A", "B", "C", "D")
CONTINUATIONS = tuple(" " + letter for letter in LETTERS)  # target delimiter " " + choice
COLUMNS = ("subject", "question", "choices", "answer")
SCHEMA_HINT = "expected the cais/mmlu schema: subject, question, choices (4 strings), answer (0-3)"

DATA_DIR = Path(__file__).parents[1] / "data"  # llmopt/eval/data
BUNDLED_TEST = DATA_DIR / "mmlu_subset.jsonl.gz"
# The whole dev split (285 examples, 5 per subject, in the original order): few-shot offline.
BUNDLED_DEV = DATA_DIR / "mmlu_dev.jsonl.gz"
FILE_SUFFIXES = (".jsonl.gz", ".jsonl", ".parquet", ".json")


@dataclass(frozen=True)
class MMLUQuestion:
    subject: str  # a cais/mmlu config name, e.g. "abstract_algebra"
    question: str
    choices: tuple[str, str, str, str]
    answer: int  # index of the right choice, 0-3

    @property
    def group(self) -> str:
        return SUBJECTS[self.subject]


@dataclass(frozen=True)
class MMLURequest:
    context: str  # description + few-shot examples + the question, ending in "Answer:"
    continuations: tuple[str, ...] = CONTINUATIONS


@dataclass
class Score:
    acc: float
    acc_stderr: float | None  # None where undefined (fewer than two questions)
    n: int

    def to_dict(self) -> dict[str, Any]:
        return {"acc": self.acc, "acc_stderr": self.acc_stderr, "n": self.n}


@dataclass
class MMLUResult:
    overall: Score
    groups: dict[str, Score]  # only the groups that had questions, in GROUPS order
    subjects: dict[str, Score]  # alphabetical
    correct: list[int]  # 0/1 per question, in input order: what a paired bootstrap resamples
    predicted: list[int]  # index of the chosen letter per question
    num_fewshot: int = 0

    def to_dict(self, samples: bool = False) -> dict[str, Any]:
        """Plain data for `--json`; `samples` adds the per-question vectors."""
        out: dict[str, Any] = {
            "num_fewshot": self.num_fewshot,
            **self.overall.to_dict(),
            "groups": {name: score.to_dict() for name, score in self.groups.items()},
            "subjects": {name: {**score.to_dict(), "group": SUBJECTS[name]} for name, score in self.subjects.items()},
        }
        if samples:
            out["correct"] = list(self.correct)
            out["predicted"] = list(self.predicted)
        return out

    def lm_eval_results(self) -> dict[str, dict[str, Any]]:
        """The same figures keyed like the "results" section of an lm-eval output file."""
        def entry(score: Score, alias: str) -> dict[str, Any]:
            stderr = "N/A" if score.acc_stderr is None else score.acc_stderr
            return {"alias": alias, "acc,none": score.acc, "acc_stderr,none": stderr}

        out = {"mmlu": entry(self.overall, "mmlu")}
        for group, score in self.groups.items():
            out[f"mmlu_{group}"] = entry(score, f" - {group}")
            for subject, sub in self.subjects.items():
                if SUBJECTS[subject] == group:
                    out[f"mmlu_{subject}"] = entry(sub, f"  - {subject}")
        return out


# ---------------------------------------------------------------------------- loading


def load_mmlu(source: str | os.PathLike[str] | None = None, split: str = "test") -> list[MMLUQuestion]:
    """Questions of one split from the bundled subset (None), a local file or folder, or "hf:name[:config]".

    For a local file, `split="test"` reads that file and any other split reads its sibling
    `{split}.jsonl.gz` (or .jsonl/.parquet/.json, or hub-style `{split}-*.parquet`); for a
    folder, both come from those names inside it.
    """
    if source is None or str(source) == "bundled":
        return _load_bundled(split)
    text = str(source)
    if text.startswith("hf:"):
        return _load_hub(text[3:], split)
    return _load_local(Path(text).expanduser(), split)


def _load_bundled(split: str) -> list[MMLUQuestion]:
    if split == "test":
        return _read_questions([BUNDLED_TEST])
    if split == "dev" and BUNDLED_DEV.exists():
        return _read_questions([BUNDLED_DEV])
    raise LlmoptError(
        f"the bundled MMLU subset has no {split} split (so no few-shot examples); use --num-fewshot 0, "
        "or --mmlu-path pointing at a test file with a dev.jsonl.gz beside it, or --mmlu-path hf:cais/mmlu"
    )


def _load_local(path: Path, split: str) -> list[MMLUQuestion]:
    if not path.exists():
        raise LlmoptError(
            f"MMLU data file {path} does not exist; --mmlu-path takes a .jsonl, .jsonl.gz, .parquet or .json "
            "file in the cais/mmlu schema, or hf:cais/mmlu"
        )
    if path.is_file() and split == "test":
        return _read_questions([path])
    folder = path if path.is_dir() else path.parent
    files = _split_files(folder, split)
    if not files:
        names = ", ".join(f"{split}{suffix}" for suffix in FILE_SUFFIXES)
        why = " (few-shot examples come from the dev split)" if split == "dev" else ""
        raise LlmoptError(f"no MMLU {split} split in {folder}: expected one of {names}{why}")
    return _read_questions(files)


def _split_files(folder: Path, split: str) -> list[Path]:
    for suffix in FILE_SUFFIXES:
        if (folder / f"{split}{suffix}").is_file():
            return [folder / f"{split}{suffix}"]
    return sorted(folder.glob(f"{split}-*.parquet"))  # a snapshot of the hub repo: all/test-00000-of-00001.parquet


def _read_questions(paths: Sequence[Path]) -> list[MMLUQuestion]:
    questions: list[MMLUQuestion] = []
    for path in paths:
        records = _read_records(path)
        if not records:
            raise LlmoptError(f"{path} holds no questions")
        questions.extend(_to_question(record, f"{path}: record {i}") for i, record in enumerate(records, 1))
    return questions


def _read_records(path: Path) -> list[Any]:
    name = path.name.lower()
    try:
        if name.endswith(".parquet"):
            try:
                import pyarrow.parquet as pq
            except ImportError as e:
                raise LlmoptError(f"reading {path} needs pyarrow (pip install 'llmopt[eval]')") from e
            return pq.read_table(path).to_pylist()
        if name.endswith((".jsonl", ".jsonl.gz")):
            opener = gzip.open if name.endswith(".gz") else open
            records = []
            with opener(path, "rt", encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            records.append(json.loads(line))
                        except json.JSONDecodeError as e:
                            raise LlmoptError(f"{path}: line {lineno} is not valid JSON ({e.msg})") from e
            return records
        if name.endswith(".json"):
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, list):
                raise LlmoptError(f"{path}: expected a JSON list of questions, got {type(data).__name__}")
            return data
    except LlmoptError:
        raise
    except json.JSONDecodeError as e:
        raise LlmoptError(f"{path} is not valid JSON ({e.msg}, line {e.lineno})") from e
    except (OSError, EOFError, UnicodeDecodeError, ValueError) as e:
        # gzip.BadGzipFile is an OSError; pyarrow's ArrowInvalid is a ValueError
        raise LlmoptError(f"cannot read {path}: {e}") from e
    raise LlmoptError(f"{path}: unsupported MMLU file type; use .jsonl, .jsonl.gz, .parquet or .json")


def _to_question(record: Any, where: str) -> MMLUQuestion:
    if not isinstance(record, dict):
        raise LlmoptError(f"{where} is a {type(record).__name__}, not an object; {SCHEMA_HINT}")
    missing = [column for column in COLUMNS if column not in record]
    if missing:
        raise LlmoptError(f"{where} has no {', '.join(missing)} column; {SCHEMA_HINT}")
    subject, question, choices, answer = (record[column] for column in COLUMNS)
    if subject not in SUBJECTS:
        raise LlmoptError(f"{where}: unknown subject {subject!r}; expected one of MMLU's 57, e.g. 'abstract_algebra'")
    if not isinstance(question, str):
        raise LlmoptError(f"{where}: question must be a string, got {type(question).__name__}")
    if not isinstance(choices, (list, tuple)) or len(choices) != 4 or not all(isinstance(c, str) for c in choices):
        raise LlmoptError(f"{where}: choices must be a list of 4 strings, got {choices!r:.80}")
    if isinstance(answer, bool) or not isinstance(answer, numbers.Integral) or not 0 <= answer <= 3:
        raise LlmoptError(f"{where}: answer must be an integer 0-3 (the index of the right choice), got {answer!r}")
    return MMLUQuestion(subject=subject, question=question, choices=tuple(choices), answer=int(answer))


def _load_hub(spec: str, split: str) -> list[MMLUQuestion]:
    name, _, config = spec.partition(":")
    config = config or "all"
    where = f"hf:{name}:{config} ({split} split)"
    fallback = "pass --mmlu-path with a local file in the cais/mmlu schema, or leave it out to use the bundled subset"
    try:
        import datasets
    except ImportError as e:
        raise LlmoptError(f"reading {where} needs the datasets package (pip install 'llmopt[eval]'), "
                          f"or {fallback}") from e
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # offline: ConnectionError; unknown name/config/split: several types
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "false", "")
        if offline or isinstance(e, ConnectionError):
            reason += "; the hub is unreachable (HF_HUB_OFFLINE is set)" if offline else "; the hub is unreachable"
        raise LlmoptError(f"cannot load {where} with datasets: {reason}. Offline or no hub: {fallback}") from e
    missing = [column for column in COLUMNS if column not in ds.column_names]
    if missing:
        raise LlmoptError(f"{where} has no {', '.join(missing)} column; {SCHEMA_HINT}")
    return [_to_question(record, f"{where}: record {i}") for i, record in enumerate(ds, 1)]


# ---------------------------------------------------------------------------- prompts


# lm-evaluation-harness's MMLU prompt (its `_default_template_yaml`, zero-shot) over a local JSONL of
# questions: `write_lm_eval_task` fills in the task name and the rows file
LM_EVAL_TASK_YAML = """\
task: {task}
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


def write_lm_eval_task(questions: Sequence[MMLUQuestion], folder: Path, task: str = "llmopt_mmlu") -> Path:
    """`questions` as an lm-evaluation-harness task for `--include_path folder`: folder/<task>.yaml
    (lm-eval's MMLU prompt, zero-shot) and the rows it reads, folder/<task>.jsonl. Returns the YAML."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = (folder / f"{task}.jsonl").resolve()
    rows.write_text("".join(json.dumps({"subject": q.subject, "question": q.question, "choices": list(q.choices),
                                        "answer": q.answer}) + "\n" for q in questions), encoding="utf-8")
    yaml = folder / f"{task}.yaml"
    yaml.write_text(LM_EVAL_TASK_YAML.format(task=task, rows=rows), encoding="utf-8")
    return yaml


def description(subject: str) -> str:
    return f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"


def format_question(q: MMLUQuestion) -> str:
    """lm-eval's `doc_to_text`: the question (stripped), the four choices, "Answer:"."""
    lines = [q.question.strip()] + [f"{letter}. {choice}" for letter, choice in zip(LETTERS, q.choices)]
    return "\n".join(lines) + "\nAnswer:"


def build_requests(
    questions: Sequence[MMLUQuestion], num_fewshot: int = 0, dev: Sequence[MMLUQuestion] | None = None
) -> list[MMLURequest]:
    """One request per question: its context and the four continuations " A".." D"."""
    if isinstance(num_fewshot, bool) or not isinstance(num_fewshot, int) or num_fewshot < 0:
        raise LlmoptError(f"--num-fewshot must be a non-negative integer, got {num_fewshot!r}")
    if num_fewshot > 0 and dev is None:
        raise LlmoptError(
            f"--num-fewshot {num_fewshot} needs MMLU's dev split and this data source has none; "
            "use --num-fewshot 0 or a source with a dev split (hf:cais/mmlu, or a dev.jsonl.gz beside --mmlu-path)"
        )
    dev_by_subject: dict[str, list[MMLUQuestion]] = {}
    for example in dev or ():
        dev_by_subject.setdefault(example.subject, []).append(example)
    prefixes: dict[str, str] = {}  # every question of a subject shares the same description and shots
    requests = []
    for q in questions:
        if q.subject not in prefixes:
            shots = dev_by_subject.get(q.subject, [])[:num_fewshot]  # lm-eval's first_n sampler
            if len(shots) < num_fewshot:
                raise LlmoptError(
                    f"--num-fewshot {num_fewshot}: the dev split has only {len(shots)} examples for {q.subject}"
                )
            examples = "".join(f"{format_question(s)} {LETTERS[s.answer]}\n\n" for s in shots)
            prefixes[q.subject] = description(q.subject) + examples
        requests.append(MMLURequest(context=prefixes[q.subject] + format_question(q)))
    return requests


def apply_limit(questions: Sequence[MMLUQuestion], limit: int | float | None) -> list[MMLUQuestion]:
    """Keep the first `limit` questions of each subject (a fraction < 1: ceil(limit * n)), like lm-eval."""
    if limit is None:
        return list(questions)
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0:
        raise LlmoptError(f"--limit must be a positive number, got {limit!r}")
    counts: dict[str, int] = {}
    for q in questions:
        counts[q.subject] = counts.get(q.subject, 0) + 1
    keep = {s: math.ceil(n * limit) if limit < 1 else int(limit) for s, n in counts.items()}
    kept: list[MMLUQuestion] = []
    seen: dict[str, int] = {}
    for q in questions:
        seen[q.subject] = seen.get(q.subject, 0) + 1
        if seen[q.subject] <= keep[q.subject]:
            kept.append(q)
    return kept


# ---------------------------------------------------------------------------- scoring


def pooled_stderr(stderrs: Sequence[float | None], sizes: Sequence[int]) -> float | None:
    """lm-eval's `pooled_sample_stderr` for a size-weighted group of sub-scores."""
    if any(s is None for s in stderrs) or sum(sizes) - len(sizes) <= 0:
        return None
    variance = sum((n - 1) * s**2 * n for s, n in zip(stderrs, sizes)) / (sum(sizes) - len(sizes))
    return math.sqrt(variance / sum(sizes))


def _group_score(parts: Iterable[Score]) -> Score:
    parts = list(parts)
    n = sum(p.n for p in parts)
    acc = sum(p.acc * p.n for p in parts) / n  # weighted by document count
    return Score(acc=acc, acc_stderr=pooled_stderr([p.acc_stderr for p in parts], [p.n for p in parts]), n=n)


def score_mmlu(questions: Sequence[MMLUQuestion], loglikelihoods: Sequence[Sequence[float]]) -> MMLUResult:
    """Accuracy per subject, per group and overall from the four log-likelihoods of each question."""
    if len(loglikelihoods) != len(questions):
        raise ValueError(f"{len(loglikelihoods)} log-likelihood rows for {len(questions)} questions")
    if not questions:
        raise LlmoptError("no MMLU questions to score")
    predicted, correct = [], []
    by_subject: dict[str, list[int]] = {}
    for q, row in zip(questions, loglikelihoods):
        if len(row) != len(LETTERS):
            raise ValueError(f"expected 4 log-likelihoods per question, got {len(row)}")
        choice = max(range(len(row)), key=lambda i: row[i])  # first maximum, as numpy's argmax
        predicted.append(choice)
        correct.append(int(choice == q.answer))
        by_subject.setdefault(q.subject, []).append(correct[-1])
    subjects = {
        s: Score(acc=sum(v) / len(v), acc_stderr=stats.stderr(v), n=len(v)) for s, v in sorted(by_subject.items())
    }
    groups = {
        g: _group_score(score for s, score in subjects.items() if SUBJECTS[s] == g)
        for g in GROUPS
        if any(SUBJECTS[s] == g for s in subjects)
    }
    return MMLUResult(
        overall=_group_score(groups.values()), groups=groups, subjects=subjects, correct=correct, predicted=predicted
    )


LoglikelihoodFn = Callable[[list[tuple[str, str]]], Sequence[float]]


def evaluate_mmlu(
    questions: Sequence[MMLUQuestion],
    loglikelihood_fn: LoglikelihoodFn,
    num_fewshot: int = 0,
    dev: Sequence[MMLUQuestion] | None = None,
    limit: int | float | None = None,
) -> MMLUResult:
    """Score a model given as a batched log-likelihood function over (context, continuation) pairs.

    The function gets every pair in one call (4 per question, contexts repeated, so a prefix
    cache pays off) and returns log P(continuation | context) for each, in order.
    """
    questions = apply_limit(questions, limit)
    requests = build_requests(questions, num_fewshot, dev)
    pairs = [(r.context, c) for r in requests for c in r.continuations]
    flat = list(loglikelihood_fn(pairs))
    if len(flat) != len(pairs):
        raise ValueError(f"loglikelihood_fn returned {len(flat)} values for {len(pairs)} requests")
    k = len(CONTINUATIONS)
    result = score_mmlu(questions, [flat[i : i + k] for i in range(0, len(flat), k)])
    result.num_fewshot = num_fewshot
    return result
