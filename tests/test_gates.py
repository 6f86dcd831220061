"""Quality gates: parsing, verdicts on paired metrics, and the statistics behind them."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmopt.errors import LlmoptError
from llmopt.eval.gates import (
    ABSOLUTE,
    CHANGE,
    RELATIVE,
    MetricSamples,
    evaluate_gates,
    exit_code,
    parse_gates,
)
from llmopt.eval.stats import bootstrap_ci, mean_stderr, paired_bootstrap_ci, quantile_ci


def paired_accuracy(n: int, base_correct: int, lost: int, gained: int, seed: int = 0):
    """0/1 arrays on n items: the candidate loses `lost` of the baseline's right answers
    and gets `gained` of its wrong ones right (shuffled so no block is special)."""
    base = np.zeros(n)
    base[:base_correct] = 1
    cand = base.copy()
    cand[:lost] = 0
    cand[base_correct : base_correct + gained] = 1
    perm = np.random.default_rng(seed).permutation(n)
    return base[perm], cand[perm]


def judge(spec: str, samples: MetricSamples, metric: str | None = None):
    (gate,) = parse_gates(spec)
    (result,) = evaluate_gates([gate], {metric or gate.metric: samples})
    return result


# --- parsing ---------------------------------------------------------------------------


def test_parse_the_issue_example():
    gates = parse_gates("mmlu.acc:-1.0,humaneval.pass@1:-2.0,kld.mean:0.05,ppl:+5%")
    assert [(g.metric, g.kind) for g in gates] == [
        ("mmlu.acc", CHANGE),
        ("humaneval.pass@1", CHANGE),
        ("kld.mean", ABSOLUTE),
        ("ppl.ppl", RELATIVE),
    ]
    limits = [g.limit for g in gates]
    assert limits == pytest.approx([-0.01, -0.02, 0.05, 0.05])  # points -> fractions; % -> ratio
    assert gates[0].text == "mmlu.acc:-1.0" and gates[3].text == "ppl.ppl:+5%"


def test_parse_other_forms_and_lists():
    gates = parse_gates(["mmlu.acc:-2%", " ppl.nll:+0.02 ", "kld.p99:<=1e-1,kld.same_top_p:90%", "mmlu:>=40", "kld:0"])
    got = [(g.metric, g.kind, round(g.limit, 12)) for g in gates]
    assert got == [
        ("mmlu.acc", RELATIVE, -0.02),
        ("ppl.nll", CHANGE, 0.02),
        ("kld.p99", ABSOLUTE, 0.1),
        ("kld.same_top_p", ABSOLUTE, 0.9),
        ("mmlu.acc", ABSOLUTE, 0.4),
        ("kld.mean", ABSOLUTE, 0.0),
    ]
    assert parse_gates("mmlu.acc:+0")[0].limit == 0  # zero may carry either sign
    assert parse_gates([]) == []


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("mmlu.acc", "expected METRIC:BOUND"),
        ("mmlu.acc:abc", "not a number"),
        ("ppl:+5%%", "not a number"),
        (":1", "missing metric name"),
        ("", "empty gate spec"),
        ("   ", "empty gate spec"),
        ("mmlu.acc:-1,", "empty gate between commas"),
        ("bogus.acc:-1", "unknown metric 'bogus.acc'"),
        ("mmlu.f1:-1", "known metrics"),
        ("mmlu.acc:nan", "not a number"),
        ("mmlu.acc:+1.0", "would demand an improvement"),
        ("ppl:-5%", "would demand an improvement"),
        ("mmlu.acc:1.0", "ambiguous"),
        ("kld.mean:+0.05", "no baseline value"),
        ("kld.mean:>=0.05", "threshold is <="),
        ("kld.mean:5%", "not a percentage"),
        ("kld.same_top_p:0.9", "in percent"),
        ("mmlu.acc:>=140", "in percent"),
    ],
)
def test_malformed_gates_are_clear_errors(spec, fragment):
    with pytest.raises(LlmoptError) as exc:
        parse_gates(spec)
    assert fragment in str(exc.value)


def test_recipe_numbers_must_be_strings():
    # YAML reads `+0.5` as 0.5: the sign would be silently lost.
    with pytest.raises(LlmoptError, match="quoted string"):
        parse_gates(["mmlu.acc:-1.0", -1.0])
    with pytest.raises(LlmoptError, match="string or a list"):
        parse_gates({"mmlu.acc": "-1.0"})


def test_unknown_or_unpaired_metric_at_evaluation():
    gates = parse_gates("humaneval.pass@1:-2.0")
    with pytest.raises(LlmoptError, match="available metrics: mmlu.acc, ppl.ppl"):
        evaluate_gates(gates, {"mmlu.acc": MetricSamples(np.ones(3), np.ones(3)), "ppl": MetricSamples(np.ones(3), np.ones(3))})
    with pytest.raises(LlmoptError, match="no baseline values"):
        evaluate_gates(parse_gates("mmlu.acc:-1"), {"mmlu.acc": MetricSamples(np.ones(3))})
    with pytest.raises(LlmoptError, match="differ in length"):
        MetricSamples(np.ones(3), np.ones(4))


# --- verdicts --------------------------------------------------------------------------


def test_baseline_against_itself_passes_with_zero_change():
    base, _ = paired_accuracy(500, 300, 0, 0)
    nll = np.random.default_rng(0).gamma(2.0, 1.0, 2000)
    samples = {"mmlu.acc": MetricSamples(base, base.copy()), "ppl": MetricSamples(nll, nll.copy(), transform=np.exp)}
    results = evaluate_gates(parse_gates("mmlu.acc:-0,mmlu.acc:-1.0,ppl:+0%,ppl:+5%"), samples)
    for r in results:
        assert r.passed and r.delta == 0 and (r.ci_low, r.ci_high) == (0, 0)
        assert not r.significant and r.conclusive
    assert exit_code(results) == 0


def test_ten_point_drop_on_1000_items_fails_significantly():
    base, cand = paired_accuracy(1000, 700, 150, 50)  # 70% -> 60%
    r = judge("mmlu.acc:-1.0", MetricSamples(cand, base))
    assert (r.baseline, r.candidate) == pytest.approx((0.7, 0.6))
    assert r.delta == pytest.approx(-0.1)
    assert r.ci_low < -0.1 < r.ci_high < -0.01
    assert not r.passed and r.significant and r.conclusive
    assert r.note.startswith("fail (significant)")
    assert exit_code([r]) == 1


def test_half_point_drop_at_n200_passes():
    base, cand = paired_accuracy(200, 120, 4, 3)  # net one item = -0.5 points
    r = judge("mmlu.acc:-1.0", MetricSamples(cand, base))
    assert r.delta == pytest.approx(-0.005)
    assert r.passed and not r.significant and not r.conclusive
    assert r.note.startswith("pass (within noise at n=200)")


def test_two_point_drop_at_n100_fails_within_noise():
    base, cand = paired_accuracy(100, 60, 10, 8)  # net -2 points, lots of churn
    r = judge("mmlu.acc:-1.0", MetricSamples(cand, base))
    assert r.delta == pytest.approx(-0.02)
    assert r.ci_low < -0.01 and r.ci_high > 0  # straddles the bound and zero
    assert not r.passed and not r.significant and not r.conclusive
    assert r.note.startswith("fail (within noise at n=100)")


def test_exact_bound_passes_despite_float_rounding():
    base, cand = paired_accuracy(100, 61, 1, 0)  # 0.61 -> 0.60: -0.010000000000000009
    assert judge("mmlu.acc:-1.0", MetricSamples(cand, base)).passed


def test_relative_ppl_gate_by_hand():
    rng = np.random.default_rng(0)
    nll = np.log(10.0) + rng.normal(0, 0.5, 5000)
    ppl_base = math.exp(nll.mean())
    for ratio, passes in [(1.04, True), (1.06, False)]:
        r = judge("ppl:+5%", MetricSamples(nll + math.log(ratio), nll, transform=np.exp))
        assert r.baseline == pytest.approx(ppl_base)
        assert r.candidate == pytest.approx(ppl_base * ratio)
        assert r.delta == pytest.approx(ratio - 1)
        # Every resample shifts both means alike: the ratio, and so the CI, is exact.
        assert (r.ci_low, r.ci_high) == pytest.approx((ratio - 1, ratio - 1))
        assert r.passed is passes and r.conclusive and r.significant


def test_weighted_windows_give_token_level_ppl():
    # per-window mean NLL with tokens per window: ppl = exp(total NLL / total tokens)
    tokens = np.array([10.0, 30.0, 60.0])
    base = np.array([2.0, 2.2, 2.4])
    cand = base + np.array([0.0, 0.1, 0.0])
    r = judge("ppl:+1%", MetricSamples(cand, base, weights=tokens, transform=np.exp))
    hand_base = math.exp((10 * 2.0 + 30 * 2.2 + 60 * 2.4) / 100)
    hand_cand = math.exp((10 * 2.0 + 30 * 2.3 + 60 * 2.4) / 100)
    assert (r.baseline, r.candidate) == pytest.approx((hand_base, hand_cand))
    assert r.delta == pytest.approx(math.exp(0.03) - 1)  # +3.05% > 1%
    assert not r.passed


def test_kld_absolute_gates():
    kld = np.random.default_rng(0).gamma(0.5, 0.06, 50_000)  # mean 0.03
    samples = {
        "kld.mean": MetricSamples(kld),
        "kld.p99": MetricSamples(kld, quantile=0.99),
        "kld.same_top_p": MetricSamples((np.arange(50_000) % 20 != 0).astype(float)),  # 95%
    }
    results = evaluate_gates(parse_gates("kld.mean:0.05,kld.mean:0.02,kld.p99:1.0,kld.same_top_p:>=90"), samples)
    ok, too_high, p99, top = results
    assert ok.candidate == pytest.approx(kld.mean()) and ok.delta is None and ok.baseline is None
    assert ok.passed and ok.conclusive and ok.ci_low < kld.mean() < ok.ci_high
    assert not too_high.passed and too_high.conclusive and too_high.note.startswith("fail (significant)")
    assert p99.candidate == pytest.approx(np.quantile(kld, 0.99)) and p99.passed
    assert p99.ci_low <= p99.candidate <= p99.ci_high
    assert top.candidate == pytest.approx(0.95) and top.passed
    assert exit_code(results) == 1


def test_relative_gate_needs_positive_baseline():
    with pytest.raises(LlmoptError, match="positive baseline"):
        judge("mmlu.acc:-2%", MetricSamples(np.zeros(10), np.zeros(10)))


# --- statistics ------------------------------------------------------------------------


def test_mean_stderr_by_hand():
    mean, se = mean_stderr([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5
    assert se == pytest.approx(math.sqrt((1.5**2 + 0.5**2 + 0.5**2 + 1.5**2) / 3) / 2)
    assert math.isnan(mean_stderr([5.0])[1])
    with pytest.raises(LlmoptError):
        mean_stderr([])


def test_bootstrap_ci_covers_the_true_mean():
    rng = np.random.default_rng(123)
    hits = 0
    for trial in range(100):
        x = rng.normal(3.0, 2.0, 60)
        ci = bootstrap_ci(x, n_boot=400, seed=trial)
        hits += ci.low <= 3.0 <= ci.high
    assert hits >= 85  # nominal 95; the percentile bootstrap runs a bit short at n=60


def test_bootstrap_matches_normal_theory_and_blocks_large_arrays():
    x = np.random.default_rng(0).exponential(1.0, 300_000)
    mean, se = mean_stderr(x)
    ci = bootstrap_ci(x)  # 300k > max_blocks: resampled in contiguous blocks
    assert ci.block > 1
    assert ci.low < mean < ci.high
    assert (ci.high - ci.low) == pytest.approx(2 * 1.96 * se, rel=0.2)


def test_quantile_ci_contains_the_quantile():
    x = np.random.default_rng(0).normal(0, 1, 10_000)
    ci = quantile_ci(x, 0.5)
    assert ci.low < 0 < ci.high and ci.high - ci.low < 0.1


@settings(max_examples=40, deadline=None)
@given(
    base=st.lists(st.integers(0, 1), min_size=1, max_size=60),
    flips=st.lists(st.booleans(), min_size=60, max_size=60),
    seed=st.integers(0, 2**16),
)
def test_swapping_models_negates_delta_and_mirrors_ci(base, flips, seed):
    b = np.array(base, dtype=float)
    c = np.where(np.array(flips[: b.size]), 1 - b, b)
    forward = paired_bootstrap_ci(b, c, n_boot=200, seed=seed)
    backward = paired_bootstrap_ci(c, b, n_boot=200, seed=seed)
    assert backward.estimate == -forward.estimate
    assert backward.low == pytest.approx(-forward.high, abs=1e-12)
    assert backward.high == pytest.approx(-forward.low, abs=1e-12)
    assert forward.low <= forward.high
