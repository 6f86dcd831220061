"""Judging gates: bootstrap intervals of per-item values, read off as pass, fail or inconclusive.

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

The verdicts and the exit code they give are in `verdict.py`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from llmopt.errors import LlmoptError
from llmopt.eval.gates import stats
from llmopt.eval.gates.format import gate_note
from llmopt.eval.gates.metric_info import canonical_metric
from llmopt.eval.gates.spec import ABSOLUTE, CHANGE, RELATIVE, Gate
from llmopt.eval.gates.verdict import FAIL, INCONCLUSIVE, PASS, GateResult


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
    result.note = gate_note(gate, result, bootstrap.alpha, ci)
    return result
