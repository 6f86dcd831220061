"""Quality gates: parsing, verdicts on paired metrics, and the statistics behind them."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmopt.errors import LlmoptError
from llmopt.eval.gates.judge import Bootstrap, MetricSamples, evaluate_gates
from llmopt.eval.gates.spec import ABSOLUTE, CHANGE, RELATIVE, parse_gates
from llmopt.eval.gates.verdict import FAIL, INCONCLUSIVE, PASS, exit_code
from llmopt.eval.gates.stats import MIN_UNITS, bootstrap_ci, mean_stderr, paired_bootstrap_ci, token_block


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
        assert r.verdict == PASS and r.passed and r.delta == 0 and (r.ci_low, r.ci_high) == (0, 0)
        assert not r.significant
    assert exit_code(results) == 0 and exit_code(results, strict=True) == 0


def test_ten_point_drop_on_1000_items_fails_significantly():
    base, cand = paired_accuracy(1000, 700, 150, 50)  # 70% -> 60%
    r = judge("mmlu.acc:-1.0", MetricSamples(cand, base))
    assert (r.baseline, r.candidate) == pytest.approx((0.7, 0.6))
    assert r.delta == pytest.approx(-0.1)
    assert r.ci_low < -0.1 < r.ci_high < -0.01
    assert r.verdict == FAIL and not r.passed and r.significant and not r.point_within
    assert r.note.startswith("fail (significant)") and "entirely beyond the bound" in r.note and "n=1000 items" in r.note
    assert exit_code([r]) == 1


def test_a_small_drop_with_churn_straddles_the_bound_inconclusive():
    base, cand = paired_accuracy(200, 120, 4, 3)  # net one item = -0.5 points: the point estimate is within
    r = judge("mmlu.acc:-1.0", MetricSamples(cand, base))
    assert r.delta == pytest.approx(-0.005)
    assert r.ci_low < -0.01 < r.ci_high  # the interval straddles the bound
    assert r.verdict == INCONCLUSIVE and not r.passed and not r.significant and r.point_within
    assert r.note.startswith("inconclusive") and "straddles the bound, point estimate within it" in r.note
    assert exit_code([r]) == 0 and exit_code([r], strict=True) == 1


def test_two_point_drop_at_n100_is_inconclusive_not_a_failure():
    base, cand = paired_accuracy(100, 60, 10, 8)  # net -2 points, lots of churn: beyond the bound, but noisy
    r = judge("mmlu.acc:-1.0", MetricSamples(cand, base))
    assert r.delta == pytest.approx(-0.02)
    assert r.ci_low < -0.01 and r.ci_high > 0  # straddles the bound and zero
    assert r.verdict == INCONCLUSIVE and not r.point_within
    assert "point estimate beyond it" in r.note
    assert exit_code([r]) == 0 and exit_code([r], strict=True) == 1


def test_a_clearly_harmless_change_passes():
    base, cand = paired_accuracy(1000, 600, 10, 10)  # 2% of answers flip, net 0
    r = judge("mmlu.acc:-3.0", MetricSamples(cand, base))
    assert -0.03 < r.ci_low < 0 < r.ci_high
    assert r.verdict == PASS and "entirely within the bound" in r.note


def test_exact_bound_passes_despite_float_rounding():
    base, cand = paired_accuracy(100, 61, 1, 0)  # 0.61 -> 0.60: -0.010000000000000009, and every resample too
    assert judge("mmlu.acc:-1.0", MetricSamples(cand, base)).point_within


@pytest.mark.parametrize("n", [1, 2, MIN_UNITS - 1])
def test_below_the_minimum_sample_size_there_is_no_interval(n):
    base, cand = np.ones(n), np.zeros(n)  # every item lost: a 100-point drop, yet nothing is significant at n < 30
    r = judge("mmlu.acc:-1.0", MetricSamples(cand, base))
    assert r.ci_low is None and r.ci_high is None
    assert r.verdict == INCONCLUSIVE and not r.significant and not r.point_within
    assert f"{n} items: below the minimum of {MIN_UNITS} for an interval" in r.note
    assert exit_code([r]) == 0 and exit_code([r], strict=True) == 1
    ok = judge("mmlu.acc:-1.0", MetricSamples(cand, cand.copy()))  # even the baseline against itself
    assert ok.verdict == INCONCLUSIVE and ok.ci_low is None


def test_token_level_metrics_resample_blocks_and_count_blocks_for_the_minimum():
    kld = np.random.default_rng(0).gamma(0.5, 0.06, 4080)
    r = judge("kld.mean:0.25", MetricSamples(kld, token_level=True))
    assert r.block == token_block(4080) == 16 and "n=4080 tokens, circular blocks of 16" in r.note
    assert r.verdict == PASS
    few = judge("kld.mean:0.25", MetricSamples(kld[:100], token_level=True))  # 100 tokens = 20 blocks of 5
    assert few.verdict == INCONCLUSIVE and few.ci_low is None and "20 blocks of 5 items" in few.note


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
        assert r.verdict == (PASS if passes else FAIL)


def test_weighted_windows_give_token_level_ppl():
    # per-window mean NLL with tokens per window: ppl = exp(total NLL / total tokens)
    tokens = np.tile([10.0, 30.0, 60.0], 20)
    base = np.tile([2.0, 2.2, 2.4], 20)
    cand = base + np.tile([0.0, 0.1, 0.0], 20)
    r = judge("ppl:+1%", MetricSamples(cand, base, weights=tokens, transform=np.exp))
    hand_base = math.exp((10 * 2.0 + 30 * 2.2 + 60 * 2.4) / 100)
    hand_cand = math.exp((10 * 2.0 + 30 * 2.3 + 60 * 2.4) / 100)
    assert (r.baseline, r.candidate) == pytest.approx((hand_base, hand_cand))
    assert r.delta == pytest.approx(math.exp(0.03) - 1)  # +3.05% > 1%
    assert r.verdict == FAIL


def test_kld_absolute_gates():
    kld = np.random.default_rng(0).gamma(0.5, 0.06, 50_000)  # mean 0.03
    samples = {
        "kld.mean": MetricSamples(kld, token_level=True),
        "kld.p99": MetricSamples(kld, quantile=0.99, token_level=True),
        "kld.same_top_p": MetricSamples((np.arange(50_000) % 20 != 0).astype(float), token_level=True),  # 95%
    }
    results = evaluate_gates(parse_gates("kld.mean:0.05,kld.mean:0.02,kld.p99:1.0,kld.same_top_p:>=90"), samples)
    ok, too_high, p99, top = results
    assert ok.candidate == pytest.approx(kld.mean()) and ok.delta is None and ok.baseline is None
    assert ok.verdict == PASS and ok.ci_low < kld.mean() < ok.ci_high
    assert too_high.verdict == FAIL and too_high.note.startswith("fail (significant)")
    assert p99.candidate == pytest.approx(np.quantile(kld, 0.99)) and p99.verdict == PASS
    assert p99.ci_low <= p99.candidate <= p99.ci_high
    assert top.candidate == pytest.approx(0.95) and top.verdict == PASS
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


def test_bootstrap_matches_normal_theory_on_independent_values_with_or_without_blocks():
    x = np.random.default_rng(0).exponential(1.0, 300_000)
    mean, se = mean_stderr(x)
    for block in (1, token_block(x.size)):
        ci = bootstrap_ci(x, block=block)
        assert ci.block == block and ci.low < mean < ci.high
        assert (ci.high - ci.low) == pytest.approx(2 * 1.96 * se, rel=0.2)


def test_block_bootstrap_widens_the_interval_of_correlated_values():
    # AR(1) with phi = 0.8: the variance of the mean is (1 + phi) / (1 - phi) = 9x the independent one
    rng = np.random.default_rng(0)
    e = rng.normal(0, 1, 40_000)
    x = np.empty_like(e)
    x[0] = e[0]
    for i in range(1, x.size):
        x[i] = 0.8 * x[i - 1] + e[i]
    naive = bootstrap_ci(x)
    blocked = bootstrap_ci(x, block=token_block(x.size))  # 34
    true_half = 1.96 * math.sqrt(9 * x.var() / x.size)  # var(mean) = var(x) (1 + phi) / (1 - phi) / n
    assert (blocked.high - blocked.low) / 2 == pytest.approx(true_half, rel=0.2)
    assert (naive.high - naive.low) < 0.5 * (blocked.high - blocked.low)


def test_quantile_bootstrap_contains_the_quantile():
    x = np.random.default_rng(0).normal(0, 1, 10_000)
    ci = bootstrap_ci(x, quantile=0.5, block=token_block(x.size))
    assert ci.low < 0 < ci.high and ci.high - ci.low < 0.1
    assert ci.estimate == pytest.approx(np.median(x))


def test_seed_and_samples_change_the_interval_reproducibly():
    base, cand = paired_accuracy(400, 240, 30, 20)
    s = MetricSamples(cand, base)
    one = evaluate_gates(parse_gates("mmlu.acc:-3.0"), {"mmlu.acc": s}, Bootstrap(n_boot=500, seed=1))[0]
    again = evaluate_gates(parse_gates("mmlu.acc:-3.0"), {"mmlu.acc": s}, Bootstrap(n_boot=500, seed=1))[0]
    other = evaluate_gates(parse_gates("mmlu.acc:-3.0"), {"mmlu.acc": s}, Bootstrap(n_boot=500, seed=2))[0]
    assert (one.ci_low, one.ci_high) == (again.ci_low, again.ci_high) != (other.ci_low, other.ci_high)


def test_one_bootstrap_per_metric_and_kind():
    base, cand = paired_accuracy(400, 240, 30, 20)
    boot = Bootstrap()
    s = MetricSamples(cand, base)
    evaluate_gates(parse_gates("mmlu.acc:-3.0,mmlu.acc:-5.0,mmlu.acc:-2%"), {"mmlu.acc": s}, boot)
    assert set(boot._done) == {("mmlu.acc", CHANGE), ("mmlu.acc", RELATIVE)}
    assert boot.interval("mmlu", s, CHANGE) is boot._done[("mmlu.acc", CHANGE)]


@settings(max_examples=40, deadline=None)
@given(
    base=st.lists(st.integers(0, 1), min_size=MIN_UNITS, max_size=60),
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
