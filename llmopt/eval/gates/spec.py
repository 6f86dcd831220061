"""Gate specs: the `METRIC:BOUND` syntax, parsed into `Gate`s (judged in `judge.py`).

A gate spec is a comma-separated list (`--gate`) or a list of strings (a recipe) of
`METRIC:BOUND`, e.g. `mmlu.acc:-1.0,humaneval.pass@1:-2.0,kld.mean:0.05,ppl:+5%`.

Metrics are `task.metric`; a bare task means its main metric (`ppl` = `ppl.ppl`,
`kld` = `kld.mean`, `mmlu` = `mmlu.acc`, `humaneval` = `humaneval.pass@1`). Each metric
has a direction (higher is better: acc, pass@k, same_top_p; lower is better: ppl, nll,
kld.*) and a unit: accuracy-like metrics are fractions in [0, 1] shown as %, so their
bounds are written in percentage points / percent. `kld.*` metrics have no baseline value
of their own (KL divergence already compares candidate to baseline): they only take
absolute thresholds.

Bounds (the sign is part of the meaning, so it is never optional or ignored):

  `-1.0` / `+0.5`   allowed change vs the baseline, in the worse direction: `mmlu.acc:-1.0`
                    = the candidate may score at most 1.0 point (0.01) below the baseline;
                    `ppl.nll:+0.02` = NLL may rise by at most 0.02. A sign pointing the
                    *better* way (`mmlu.acc:+1.0`) would demand an improvement from a
                    quantized model: rejected as illogical (zero may carry either sign).
  `+5%` / `-2%`     allowed relative change vs the baseline: `ppl:+5%` = candidate ppl
                    ≤ 1.05 × baseline ppl; `mmlu.acc:-2%` = acc ≥ 0.98 × baseline acc.
  `0.05`, `<=0.05`  absolute threshold on the candidate's own value: a ceiling for
  `>=90`, `90%`     lower-is-better metrics, a floor for higher-is-better ones
                    (`kld.mean:0.05` = kld.mean ≤ 0.05; `kld.same_top_p:90` = ≥ 90%).
                    An explicit `>=`/`<=` works on any metric (`mmlu.acc:>=40` = at least
                    40%) and must point the metric's way. A bare unsigned number on a
                    metric that has a baseline is rejected: `mmlu.acc:1.0` reads as
                    "1 point drop" to some and "1% floor" to others. On % metrics a
                    threshold is in percent; one in (0, 1) is rejected as a likely
                    fraction (write 90 for 90%).

Anything else (no `:`, empty name, unknown metric, `abc`, `5%%`, a non-string list item)
is an `LlmoptError` (the CLI exits 2).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from llmopt.errors import LlmoptError
from llmopt.eval.gates.metric_info import MetricInfo, known_metrics, metric_info

CHANGE, RELATIVE, ABSOLUTE = "change", "relative", "absolute"
# Slack for comparing a float against a bound: a 1-item drop out of 100 must count as
# exactly 1.0 point, not 1.0000000000000009.
_TOL = 1e-9


@dataclass(frozen=True)
class Gate:
    metric: str  # canonical "task.metric"
    kind: str  # CHANGE | RELATIVE | ABSOLUTE
    limit: float  # bound on the compared quantity, native units (fractions, not %)
    text: str  # "metric:bound" as written (metric canonicalised)
    info: MetricInfo

    def satisfied(self, x: float) -> bool:
        """Whether a value of the compared quantity is within the bound."""
        if math.isnan(x):
            return False
        slack = _TOL * max(1.0, abs(self.limit))
        return x >= self.limit - slack if self.info.higher_is_better else x <= self.limit + slack


_BOUND = re.compile(r"(?P<op><=|>=|[+-])?(?P<num>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)(?P<pct>%)?")


def parse_gate(item: str) -> Gate:
    """One `METRIC:BOUND`; see the module docstring for the forms."""
    text = item.strip()
    if ":" not in text:
        raise LlmoptError(f"malformed gate {text!r}: expected METRIC:BOUND, e.g. mmlu.acc:-1.0 or ppl:+5%")
    name, _, bound = (part.strip() for part in text.partition(":"))
    if not name:
        raise LlmoptError(f"malformed gate {text!r}: missing metric name before ':' (known metrics: {known_metrics()})")
    info = metric_info(name)
    m = _BOUND.fullmatch(bound.replace(" ", ""))
    if m is None:
        raise LlmoptError(
            f"malformed gate {text!r}: bound {bound!r} is not a number; write -1.0 (change), +5% (relative) "
            "or 0.05 / >=90 (absolute threshold)"
        )
    op, pct, value = m["op"], m["pct"] is not None, float(m["num"])
    if not math.isfinite(value):
        raise LlmoptError(f"malformed gate {text!r}: bound is not finite")
    normalised = f"{info.name}:{bound.replace(' ', '')}"
    scale = 0.01 if info.percent else 1.0
    worse = "-" if info.higher_is_better else "+"

    if op in ("+", "-"):
        if not info.paired:
            raise LlmoptError(
                f"gate {text!r}: {info.name} has no baseline value to change from; give an absolute threshold, "
                f"e.g. {info.name}:{value:g}"
            )
        if op != worse and value != 0:
            better = "higher" if info.higher_is_better else "lower"
            raise LlmoptError(
                f"gate {text!r}: {info.name} is better when {better}, so the allowed change must be "
                f"{worse}{bound.lstrip('+-')} ({op}{bound.lstrip('+-')} would demand an improvement)"
            )
        signed = value if op == "+" else -value
        if pct:
            return Gate(info.name, RELATIVE, signed / 100.0, normalised, info)
        return Gate(info.name, CHANGE, signed * scale, normalised, info)

    if op is None and info.paired:
        pts = "points" if info.percent else "units"
        raise LlmoptError(
            f"gate {text!r} is ambiguous: write {info.name}:{worse}{bound.rstrip('%')} for an allowed change of "
            f"{bound.rstrip('%')} {pts} vs the baseline, {info.name}:{worse}{bound.rstrip('%')}% for a relative one, "
            f"or {info.name}:{'>=' if info.higher_is_better else '<='}{bound} for a threshold on the candidate's own value"
        )
    if op is not None and (op == ">=") != info.higher_is_better:
        want = ">=" if info.higher_is_better else "<="
        raise LlmoptError(f"gate {text!r}: {info.name} is better when {'higher' if info.higher_is_better else 'lower'}, so its threshold is {want}")
    if pct and not info.percent:
        raise LlmoptError(f"gate {text!r}: {info.name} is not a percentage; give its threshold without %")
    if info.percent and (value > 100 or 0 < value < 1):
        raise LlmoptError(f"gate {text!r}: {info.name} thresholds are in percent (write 90 for 90%), got {bound}")
    return Gate(info.name, ABSOLUTE, value * scale, normalised, info)


def parse_gates(spec: str | Iterable[str]) -> list[Gate]:
    """A comma-separated `--gate` string, or a list of such strings (from a recipe)."""
    if isinstance(spec, str):
        if not spec.strip():
            raise LlmoptError("empty gate spec: expected METRIC:BOUND[,METRIC:BOUND...], e.g. mmlu.acc:-1.0,ppl:+5%")
        items = spec.split(",")
    elif isinstance(spec, Iterable) and not isinstance(spec, (bytes, Mapping)):
        items = []
        for i, s in enumerate(spec):
            if not isinstance(s, str):
                # YAML reads `+0.5` as the float 0.5: the sign, which is the meaning, is lost.
                raise LlmoptError(
                    f"gate #{i + 1} is a {type(s).__name__} ({s!r}); write each gate as a quoted string, e.g. \"mmlu.acc:-1.0\""
                )
            items.extend(s.split(","))
    else:
        raise LlmoptError(f"gates must be a string or a list of strings, got {type(spec).__name__}")
    gates = []
    for item in items:
        if not item.strip():
            raise LlmoptError(f"malformed gate spec {spec!r}: an empty gate between commas")
        gates.append(parse_gate(item))
    return gates
