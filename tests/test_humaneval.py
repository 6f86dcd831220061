"""HumanEval: problems, prompts, answer post-processing, pass@k and scoring in the sandbox."""

from __future__ import annotations

import gzip
import json
import logging
import math
import sys
import time
from fractions import Fraction

import pytest

from llmopt.errors import LlmoptError
from llmopt.eval.metrics import humaneval
from llmopt.eval.metrics.humaneval import (
    STOP_SEQUENCES,
    Problem,
    build_program,
    build_test,
    chat_messages,
    extract_code,
    load_problems,
    pass_at_k,
    score,
    truncate_completion,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox's containment needs Linux")

MEMORY_MB = 512


@pytest.fixture(scope="module")
def problems() -> list[Problem]:
    return load_problems()


# --- pass@k --------------------------------------------------------------------------

def closed_form(n: int, c: int, k: int) -> float:
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def test_pass_at_k_hand_cases():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2) = 0.7
    assert pass_at_k(5, 0, 1) == 0.0
    assert pass_at_k(5, 0, 5) == 0.0
    assert pass_at_k(5, 4, 2) == 1.0  # n - c = 1 < k: every pair holds a correct sample
    assert pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(1, 1, 1) == 1.0 and pass_at_k(1, 0, 1) == 0.0


def test_pass_at_k_matches_the_closed_form():
    for n in range(1, 21):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(closed_form(n, c, k), abs=1e-12), (n, c, k)
    # Large n: the product form never builds C(200, 100) ~ 9e58, and still agrees.
    assert pass_at_k(200, 3, 100) == pytest.approx(closed_form(200, 3, 100), rel=1e-12)
    assert pass_at_k(200, 37, 10) == pytest.approx(closed_form(200, 37, 10), rel=1e-12)


@pytest.mark.parametrize("n, c, k", [(0, 0, 1), (5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(LlmoptError):
        pass_at_k(n, c, k)


# --- problems ------------------------------------------------------------------------

def test_bundled_problems(problems):
    assert len(problems) == 164
    assert len({p.task_id for p in problems}) == 164
    first = problems[0]
    assert first.task_id == "HumanEval/0"
    assert first.entry_point == "has_close_elements"
    assert first.prompt.startswith("from typing import List") and "def check(candidate)" in first.test


def test_missing_package_is_explained(monkeypatch):
    monkeypatch.setattr(humaneval.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(LlmoptError, match="pip install"):
        load_problems()


def test_problem_files(tmp_path, problems):
    rows = [{f: getattr(p, f) for f in Problem.__dataclass_fields__} for p in problems[:3]]
    plain = tmp_path / "three.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n\n" for r in rows))
    packed = tmp_path / "three.jsonl.gz"
    with gzip.open(packed, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    assert load_problems(plain) == load_problems(packed) == problems[:3]

    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"task_id": \n')
    missing_field = tmp_path / "missing.jsonl"
    missing_field.write_text(json.dumps({"task_id": "x", "prompt": "y"}) + "\n")
    duplicated = tmp_path / "dup.jsonl"
    duplicated.write_text((json.dumps(rows[0]) + "\n") * 2)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    for path in (bad_json, missing_field, duplicated, empty, tmp_path / "absent.jsonl"):
        with pytest.raises(LlmoptError):
            load_problems(path)


# --- prompts and answers ---------------------------------------------------------------

def test_truncate_completion():
    body = "    return sorted(x)\n"
    assert truncate_completion(body) == body
    assert truncate_completion(body + "\n\ndef main():\n    pass\n") == body + "\n"
    assert truncate_completion(body + "\nif __name__ == '__main__':\n    main()\n") == body
    assert truncate_completion(body + "\nprint(f([1]))\n") == body
    assert truncate_completion(body + "\n# tests\n") == body
    assert truncate_completion(body + "\n```\nThat is it.") == body
    # The earliest stop wins, and indented lines never stop a body.
    nested = "    if x:\n        # note\n        return 1"
    assert truncate_completion(nested + "\nclass A:\n#\n") == nested
    assert truncate_completion("abcSTOPdef", stop=["def", "STOP"]) == "abc"
    assert truncate_completion("abc", stop=[]) == "abc"
    assert "\ndef" in STOP_SEQUENCES


def test_chat_messages_carry_the_prompt(problems):
    messages = chat_messages(problems[0])
    assert [m["role"] for m in messages] == ["user"]
    assert problems[0].prompt.strip() in messages[0]["content"]
    assert "```python" in messages[0]["content"]


def test_extract_code(problems):
    problem = problems[0]
    function = "def has_close_elements(numbers, threshold):\n    return False\n"
    assert extract_code(f"Sure!\n```python\n{function}```\nIt works because...", problem) == function
    # The block that defines the entry point wins over an example block.
    answer = f"Example:\n```python\nprint(1)\n```\nSolution:\n```python\n{function}```\n"
    assert extract_code(answer, problem) == function
    # A block cut off by the token limit, and an answer with no fence at all.
    assert extract_code(f"```python\n{function}", problem) == function
    assert extract_code(function, problem) == function
    # A demo under a main guard is dropped.
    assert extract_code(f"```py\n{function}\nif __name__ == '__main__':\n    print(input())\n```", problem) == function
    # Indented blocks are dedented.
    assert extract_code("```\n    x = 1\n    y = 2\n```", problem) == "x = 1\ny = 2\n"


def test_build_program_completion_mode(problems):
    problem = problems[0]
    completion = "    return True\n"
    expected = problem.prompt + completion + "\n"
    assert build_program(problem, completion) == expected
    assert build_program(problem, completion + "\ndef extra():\n    pass\n") == expected  # cut at the stop
    assert build_program(problem, completion + "\ndef extra():\n    pass\n", stop=()).endswith("def extra():\n    pass\n\n")
    # The test code runs apart, in the checker: never in the model's program.
    assert problem.test not in build_program(problem, completion)
    assert build_test(problem) == problem.prompt + "\n" + problem.test + "\n"
    with pytest.raises(LlmoptError):
        build_program(problem, completion, mode="fill-in-the-middle")


# --- scoring ---------------------------------------------------------------------------

def test_canonical_solutions_pass_and_wrong_ones_fail(os_sandbox, problems):
    chosen = problems[:10]
    completions = {p.task_id: [p.canonical_solution, "    return None\n"] for p in chosen}
    result = score(chosen, completions, ks=(1, 2), timeout_s=10, memory_mb=MEMORY_MB, workers=2)
    assert [(p.n, p.c) for p in result.problems] == [(2, 1)] * 10
    assert [s.status for s in result.samples] == ["passed", "failed"] * 10
    assert result.pass_at_k == {1: pytest.approx(0.5), 2: pytest.approx(1.0)}
    assert result.per_problem(1) == [0.5] * 10


def test_chat_mode_answers(os_sandbox, problems):
    problem = problems[2]  # truncate_number: the prompt imports nothing
    full = problem.prompt + problem.canonical_solution
    answers = [
        f"Here is the function:\n\n```python\n{full}```\n\nIt drops the integer part.",
        f"```python\n{problem.canonical_solution}```",  # the body only
        problem.canonical_solution.strip(),  # the body, unfenced and unindented
        "```python\ndef truncate_number(number: float) -> float:\n    return number\n```",
        "I cannot help with that.",
    ]
    result = score([problem], {problem.task_id: answers}, mode="chat", timeout_s=10, memory_mb=MEMORY_MB, workers=2)
    assert [s.status for s in result.samples] == ["passed", "passed", "passed", "failed", "failed"]


def test_chat_mode_keeps_the_prompts_imports(os_sandbox, problems):
    problem = problems[0]  # uses `List` from the prompt's `from typing import List`
    function = "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n" + problem.canonical_solution
    result = score([problem], {problem.task_id: [f"```python\n{function}```"]}, mode="chat", memory_mb=MEMORY_MB)
    assert result.samples[0].status == "passed", result.samples[0].detail


def test_pass_at_k_over_problems_with_crashing_samples(os_sandbox, problems, caplog):
    a, b = problems[0], problems[2]
    wrong = "    return None\n"
    completions = {
        a.task_id: [a.canonical_solution, wrong, wrong, a.canonical_solution, wrong],  # c = 2 of 5
        b.task_id: [
            "    import ctypes\n    ctypes.string_at(0)\n",  # segfault
            "    while True:\n        pass\n",  # hangs
            "    return bytearray(10 * 1024**3)\n",  # too much memory
            "    import os\n    os.system('true')\n",  # shell
            wrong,
        ],
    }
    caplog.set_level(logging.WARNING, logger="llmopt.eval.metrics.humaneval")
    result = score([a, b], completions, ks=(1, 2, 5), timeout_s=1.0, memory_mb=MEMORY_MB, workers=2)
    assert [(p.task_id, p.n, p.c) for p in result.problems] == [(a.task_id, 5, 2), (b.task_id, 5, 0)]
    assert result.pass_at_k == {1: pytest.approx(0.2), 2: pytest.approx(0.35), 5: pytest.approx(0.5)}
    assert result.per_problem(1) == [pytest.approx(0.4), 0.0]
    assert [s.status for s in result.problems[1].samples] == ["failed", "timeout", "failed", "failed", "failed"]
    assert result.status_counts() == {"passed": 2, "failed": 7, "timeout": 1}
    assert "SIGSEGV" in caplog.text and b.task_id in caplog.text  # a crash is logged as one
    report = json.loads(json.dumps(result.to_dict()))
    assert report["pass_at_k"]["pass@1"] == pytest.approx(0.2)
    assert report["problems"][1]["samples"][1]["status"] == "timeout"


def test_score_rejects_bad_requests(problems):
    a = problems[0]
    good = {a.task_id: [a.canonical_solution]}
    with pytest.raises(LlmoptError, match="no completions"):
        score([a, problems[1]], good)
    with pytest.raises(LlmoptError, match="unknown"):
        score([a], {**good, "HumanEval/999": ["x"]})
    with pytest.raises(LlmoptError, match="pass@k"):
        score([a], good, ks=(2,))
    with pytest.raises(LlmoptError, match="mode"):
        score([a], good, mode="infill")
    with pytest.raises(LlmoptError):
        score([], {})


@pytest.mark.integration
def test_all_canonical_solutions_pass(os_sandbox, problems):
    start = time.monotonic()
    result = score(problems, {p.task_id: [p.canonical_solution] for p in problems}, workers=2)
    elapsed = time.monotonic() - start
    failures = [(s.task_id, s.status, s.detail) for s in result.samples if not s.passed]
    assert failures == []
    assert result.pass_at_k == {1: 1.0}
    print(f"164 canonical solutions scored in {elapsed:.1f} s")
