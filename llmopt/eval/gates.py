"""Quality gates: bounds on a candidate model's metrics vs its baseline, judged with CIs.

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

Judging a gate (`evaluate_gates`), on per-item values (`MetricSamples`):

  * The compared quantity is the change `candidate - baseline` (change gates), the
    relative change `candidate / baseline - 1` (% gates) or the candidate's value
    (absolute gates), with a 95% CI from a paired bootstrap over the same items (same
    resampled blocks for both models) or a plain bootstrap for absolute gates (`stats.py`;
    token-level metrics, ppl and kld.*, always resample blocks of consecutive tokens).
  * The verdict is read off the interval, never off the point estimate alone:
      - `pass`: the whole CI is within the bound;
      - `fail` (significant): the whole CI is beyond the bound;
      - `inconclusive`: the CI straddles the bound (more items would tell), or there are
        too few items for an interval (`stats.MIN_UNITS`; stated in the note).
    The point estimate is reported beside it (within or beyond the bound), so a reader
    sees which way an inconclusive gate leans.
  * The baseline against itself gives change 0, CI [0, 0] and passes every change or %
    gate.

Exit code (`exit_code`): 1 when a gate failed significantly; with `strict`, also when
one is inconclusive; else 0.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from llmopt.errors import LlmoptError
from llmopt.eval import stats

CHANGE, RELATIVE, ABSOLUTE = "change", "relative", "absolute"
# Slack for comparing a float against a bound: a 1-item drop out of 100 must count as
# exactly 1.0 point, not 1.0000000000000009.
_TOL = 1e-9


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


def _known_metrics() -> str:
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
    raise LlmoptError(f"unknown metric {name.strip()!r} in gate; known metrics: {_known_metrics()}")


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
        raise LlmoptError(f"malformed gate {text!r}: missing metric name before ':' (known metrics: {_known_metrics()})")
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


@dataclass
class MetricSamples:
    """Per-item values of one metric, for both models on the same items (paired).

    metric = transform(weighted mean of the values), or their `quantile` if set. Examples:
    MMLU: per-question 0/1; HumanEval: per-problem pass@1; perplexity: per-token NLL with
    transform=np.exp (or per-window mean NLL with weights=tokens per window); KLD: per-
    position KLD values as `candidate` only (baseline=None); kld.p99: quantile=0.99.
    `token_level`: consecutive items are tokens of one text, correlated, so the bootstrap
    resamples blocks of `stats.token_block(n)` of them.
    """

    candidate: np.ndarray
    baseline: np.ndarray | None = None  # same items, same order; None for KLD-type metrics
    weights: np.ndarray | None = None  # per item, shared by both models
    transform: stats.Transform | None = None
    quantile: float | None = None
    token_level: bool = False

    def __post_init__(self) -> None:
        self.candidate = stats.as_values(self.candidate, "candidate values")
        if self.baseline is not None:
            self.baseline = stats.as_values(self.baseline, "baseline values")
            if self.baseline.size != self.candidate.size:
                raise LlmoptError(
                    f"paired values differ in length: baseline {self.baseline.size}, candidate {self.candidate.size} items"
                )
        if self.weights is not None:
            self.weights = stats.as_values(self.weights, "weights")
            if self.weights.size != self.candidate.size:
                raise LlmoptError(f"weights has {self.weights.size} entries for {self.candidate.size} items")
        if self.quantile is not None and (self.transform is not None or self.weights is not None):
            raise LlmoptError("a quantile metric takes neither transform nor weights")
        if self.quantile is not None and not 0 <= self.quantile <= 1:
            raise LlmoptError(f"quantile must be in [0, 1], got {self.quantile}")

    @property
    def n(self) -> int:
        return self.candidate.size

    @property
    def block(self) -> int:
        return stats.token_block(self.n) if self.token_level else 1

    def value(self, values: np.ndarray) -> float:
        if self.quantile is not None:
            return float(np.quantile(values, self.quantile))
        f = self.transform or (lambda x: x)
        return float(f(np.asarray(stats.weighted_mean(values, self.weights))))


PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"


def display_kind(metric: str, samples: MetricSamples) -> str:
    """How the report shows a metric's change: relative for perplexity, absolute without a baseline."""
    if samples.baseline is None:
        return ABSOLUTE
    return RELATIVE if canonical_metric(metric) == "ppl.ppl" else CHANGE


@dataclass
class Bootstrap:
    """The bootstrap settings of one eval, and the intervals already computed (one per metric and kind)."""

    n_boot: int = stats.DEFAULT_N_BOOT
    seed: int = 0
    alpha: float = 0.05
    _done: dict[tuple[str, str], stats.Interval] = field(default_factory=dict, repr=False)

    def interval(self, metric: str, s: MetricSamples, kind: str) -> stats.Interval:
        """CI of the change (CHANGE), relative change (RELATIVE) or value (ABSOLUTE) of a metric."""
        key = (canonical_metric(metric), kind)
        if key not in self._done:
            boot = {"block": s.block, "n_boot": self.n_boot, "seed": self.seed, "alpha": self.alpha}
            if kind == ABSOLUTE:
                if s.quantile is not None:
                    ci = stats.bootstrap_ci(s.candidate, quantile=s.quantile, **boot)
                else:
                    ci = stats.bootstrap_ci(s.candidate, s.transform, weights=s.weights, **boot)
            else:
                if s.baseline is None:
                    raise LlmoptError(f"{metric} has no baseline values to compare with")
                if s.quantile is not None:
                    raise LlmoptError(f"{metric}: quantile metrics take absolute thresholds only")
                ci = stats.paired_bootstrap_ci(s.baseline, s.candidate, s.transform, relative=kind == RELATIVE,
                                               weights=s.weights, **boot)
            self._done[key] = ci
        return self._done[key]


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


def evaluate_gates(
    gates: list[Gate],
    samples: Mapping[str, MetricSamples],
    bootstrap: Bootstrap | None = None,
) -> list[GateResult]:
    """Judge each gate on its metric's samples; see the module docstring for the rule."""
    bootstrap = bootstrap or Bootstrap()
    by_metric: dict[str, MetricSamples] = {}
    for key, s in samples.items():
        canon = canonical_metric(key)
        if canon in by_metric:
            raise LlmoptError(f"metric {canon} given twice among the samples")
        by_metric[canon] = s
    results = []
    for gate in gates:
        s = by_metric.get(gate.metric)
        if s is None:
            have = ", ".join(sorted(by_metric)) or "none"
            raise LlmoptError(f"gate {gate.text}: {gate.metric} was not evaluated; available metrics: {have}")
        results.append(_judge(gate, s, bootstrap))
    return results


def _judge(gate: Gate, s: MetricSamples, bootstrap: Bootstrap) -> GateResult:
    base = None if s.baseline is None else s.value(s.baseline)
    cand = s.value(s.candidate)
    if gate.kind != ABSOLUTE:
        if s.baseline is None:
            raise LlmoptError(f"gate {gate.text} compares with the baseline, but {gate.metric} has no baseline values")
        if s.quantile is not None:
            raise LlmoptError(f"gate {gate.text}: quantile metrics take absolute thresholds only")
        if gate.kind == RELATIVE and not base > 0:
            raise LlmoptError(f"gate {gate.text}: a relative bound needs a positive baseline value, got {base}")
    ci = bootstrap.interval(gate.metric, s, gate.kind)
    delta = None if gate.kind == ABSOLUTE else ci.estimate
    observed = cand if gate.kind == ABSOLUTE else ci.estimate
    verdict = INCONCLUSIVE
    if ci.exists and math.isfinite(ci.low) and math.isfinite(ci.high):
        if gate.satisfied(ci.low) and gate.satisfied(ci.high):
            verdict = PASS
        elif not gate.satisfied(ci.low) and not gate.satisfied(ci.high):
            verdict = FAIL
    result = GateResult(
        gate.metric, gate.text, gate.kind, base, cand, delta, ci.low, ci.high, gate.limit,
        verdict, verdict == PASS, verdict == FAIL, gate.satisfied(observed), ci.n, ci.block, "",
    )  # fmt: skip
    result.note = _note(gate, result, bootstrap.alpha, ci)
    return result


def _fmt_value(info: MetricInfo, x: float | None) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.2f}%" if info.percent else f"{x:.4g}"


def _fmt_quantity(gate: Gate, x: float) -> str:
    """A value of the compared quantity, in the units the gate was written in."""
    if gate.kind == RELATIVE:
        return f"{100 * x:+.2f}%"
    if gate.kind == CHANGE:
        return f"{100 * x:+.2f} pts" if gate.info.percent else f"{x:+.4g}"
    return _fmt_value(gate.info, x)


def sample_description(n: int, block: int) -> str:
    """`n=285 items` or `n=4096 tokens, blocks of 16`: what the interval was resampled from."""
    return f"n={n} tokens, circular blocks of {block}" if block > 1 else f"n={n} items"


def _note(gate: Gate, r: GateResult, alpha: float, ci: stats.Interval) -> str:
    head = {PASS: "pass", FAIL: "fail (significant)", INCONCLUSIVE: "inconclusive"}[r.verdict]
    op = ">=" if gate.info.higher_is_better else "<="
    if gate.kind == ABSOLUTE:
        what = f"{gate.metric} = {_fmt_value(gate.info, r.candidate)}, bound {op} {_fmt_quantity(gate, gate.limit)}"
    else:
        what = (
            f"{gate.metric} {_fmt_value(gate.info, r.baseline)} -> {_fmt_value(gate.info, r.candidate)}, "
            f"change {_fmt_quantity(gate, r.delta)} (allowed {op} {_fmt_quantity(gate, gate.limit)})"
        )
    sample = sample_description(r.n, r.block)
    if not ci.exists:
        lean = "within" if r.point_within else "beyond"
        return f"{head}: {what}; no interval ({ci.reason}); the point estimate is {lean} the bound"
    level = f"{100 * (1 - alpha):g}% CI"
    interval = f"{level} [{_fmt_quantity(gate, r.ci_low)}, {_fmt_quantity(gate, r.ci_high)}] ({sample})"
    if r.verdict == PASS:
        return f"{head}: {what}; {interval} entirely within the bound"
    if r.verdict == FAIL:
        return f"{head}: {what}; {interval} entirely beyond the bound"
    lean = "within" if r.point_within else "beyond"
    return f"{head}: {what}; {interval} straddles the bound, point estimate {lean} it; more items would tell"
