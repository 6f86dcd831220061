"""How gates and their metrics read in notes and tables: values, changes, the verdict line."""

from __future__ import annotations

from llmopt.eval.gates import stats
from llmopt.eval.gates.metric_info import MetricInfo
from llmopt.eval.gates.spec import ABSOLUTE, CHANGE, RELATIVE, Gate
from llmopt.eval.gates.verdict import FAIL, INCONCLUSIVE, PASS, GateResult


def format_value(info: MetricInfo, x: float | None) -> str:
    """A metric's value: % for accuracy-like metrics, 4 significant digits otherwise; `-` for none."""
    if x is None:
        return "-"
    return f"{100 * x:.2f}%" if info.percent else f"{x:.4g}"


def format_quantity(info: MetricInfo, kind: str, x: float | None) -> str:
    """A value of a compared quantity of `kind` (a change, a relative change or the value itself), in the
    units a gate of that kind is written in; `-` for none."""
    if x is None:
        return "-"
    if kind == RELATIVE:
        return f"{100 * x:+.2f}%"
    if kind == CHANGE:
        return f"{100 * x:+.2f} pts" if info.percent else f"{x:+.4g}"
    return format_value(info, x)


def sample_description(n: int, block: int) -> str:
    """`n=285 items` or `n=4096 tokens, blocks of 16`: what the interval was resampled from."""
    return f"n={n} tokens, circular blocks of {block}" if block > 1 else f"n={n} items"


def gate_note(gate: Gate, r: GateResult, alpha: float, ci: stats.Interval) -> str:
    """The one-line judgement shown beside a gate: verdict, values, interval and which way it leans."""
    head = {PASS: "pass", FAIL: "fail (significant)", INCONCLUSIVE: "inconclusive"}[r.verdict]
    op = ">=" if gate.info.higher_is_better else "<="

    def quantity(x: float) -> str:
        return format_quantity(gate.info, gate.kind, x)

    if gate.kind == ABSOLUTE:
        what = f"{gate.metric} = {format_value(gate.info, r.candidate)}, bound {op} {quantity(gate.limit)}"
    else:
        what = (
            f"{gate.metric} {format_value(gate.info, r.baseline)} -> {format_value(gate.info, r.candidate)}, "
            f"change {quantity(r.delta)} (allowed {op} {quantity(gate.limit)})"
        )
    sample = sample_description(r.n, r.block)
    if not ci.exists:
        lean = "within" if r.point_within else "beyond"
        return f"{head}: {what}; no interval ({ci.reason}); the point estimate is {lean} the bound"
    level = f"{100 * (1 - alpha):g}% CI"
    interval = f"{level} [{quantity(r.ci_low)}, {quantity(r.ci_high)}] ({sample})"
    if r.verdict == PASS:
        return f"{head}: {what}; {interval} entirely within the bound"
    if r.verdict == FAIL:
        return f"{head}: {what}; {interval} entirely beyond the bound"
    lean = "within" if r.point_within else "beyond"
    return f"{head}: {what}; {interval} straddles the bound, point estimate {lean} it; more items would tell"
