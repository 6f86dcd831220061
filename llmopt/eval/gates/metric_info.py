"""The metrics gates know: each one's name, direction, unit and pairing.

Metrics are `task.metric`; a bare task means its main metric (`ppl` = `ppl.ppl`,
`kld` = `kld.mean`, `mmlu` = `mmlu.acc`, `humaneval` = `humaneval.pass@1`). Each metric
has a direction (higher is better: acc, pass@k, same_top_p; lower is better: ppl, nll,
kld.*) and a unit: accuracy-like metrics are fractions in [0, 1] shown as %. `kld.*`
metrics have no baseline value of their own (KL divergence already compares candidate to
baseline).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmopt.errors import LlmoptError


@dataclass(frozen=True)
class MetricInfo:
    name: str  # canonical "task.metric"
    higher_is_better: bool
    percent: bool  # a fraction in [0, 1] shown as %: bounds are in points / percent
    paired: bool  # False: no baseline value of its own (KLD compares the two models already)


@dataclass(frozen=True)
class _Task:
    main: str  # what a bare task name means
    paired: bool
    leaves: tuple[tuple[str, bool, bool], ...]  # (regex, higher_is_better, percent)
    known: str  # the metric names, for error messages


# The one place that knows which metrics exist and which way is better.
_TASKS: dict[str, _Task] = {
    "ppl": _Task("ppl", True, ((r"ppl|nll", False, False),), "ppl (= ppl.ppl), ppl.nll"),
    "kld": _Task(
        "mean",
        False,
        ((r"mean|median|max|p\d{1,2}(\.\d+)?", False, False), (r"same_top_p", True, True)),
        "kld (= kld.mean), kld.median, kld.max, kld.p<NN> (e.g. kld.p99), kld.same_top_p",
    ),
    "mmlu": _Task("acc", True, ((r"acc", True, True),), "mmlu (= mmlu.acc)"),
    "humaneval": _Task("pass@1", True, ((r"pass@[1-9]\d*", True, True),), "humaneval (= humaneval.pass@1), humaneval.pass@<k>"),
}


def known_metrics() -> str:
    return "; ".join(t.known for t in _TASKS.values())


def canonical_metric(name: str) -> str:
    """`ppl` -> `ppl.ppl`, `MMLU.acc` -> `mmlu.acc`; names it does not know pass through."""
    name = name.strip().lower()
    if "." not in name and name in _TASKS:
        return f"{name}.{_TASKS[name].main}"
    return name


def metric_info(name: str) -> MetricInfo:
    """Direction, unit and pairing of a metric, or LlmoptError listing the known ones."""
    canon = canonical_metric(name)
    task, _, leaf = canon.partition(".")
    spec = _TASKS.get(task)
    if spec is not None:
        for pattern, higher, percent in spec.leaves:
            if re.fullmatch(pattern, leaf):
                return MetricInfo(canon, higher, percent, spec.paired)
    raise LlmoptError(f"unknown metric {name.strip()!r} in gate; known metrics: {known_metrics()}")
