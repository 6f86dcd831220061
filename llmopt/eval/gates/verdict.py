"""A gate's verdict: pass, fail (significant) or inconclusive, with everything it was read off.

Exit code (`exit_code`): 1 when a gate failed significantly; with `strict`, also when
one is inconclusive; else 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"


@dataclass
class GateResult:
    metric: str
    bound: str  # the gate as written, e.g. "mmlu.acc:-1.0"
    kind: str  # CHANGE | RELATIVE | ABSOLUTE
    baseline: float | None  # the baseline's metric value (None: no baseline values given)
    candidate: float
    delta: float | None  # candidate - baseline; candidate/baseline - 1 for % gates; None for absolute gates
    ci_low: float | None  # CI of delta (of the candidate value for absolute gates); None: too few items
    ci_high: float | None
    limit: float  # the bound on that same quantity, native units
    verdict: str  # PASS | FAIL | INCONCLUSIVE
    passed: bool  # verdict == PASS
    significant: bool  # verdict == FAIL: the whole CI is beyond the bound
    point_within: bool  # the point estimate is within the bound (which way an inconclusive gate leans)
    n: int  # items
    block: int  # items per resampled block (1: ordinary bootstrap)
    note: str


def exit_code(results: Iterable[GateResult], strict: bool = False) -> int:
    """The CLI's exit code for `eval`: 1 when a gate failed significantly (or, if strict, was inconclusive)."""
    bad = (FAIL, INCONCLUSIVE) if strict else (FAIL,)
    return 1 if any(r.verdict in bad for r in results) else 0
