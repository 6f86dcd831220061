"""Confidence intervals for eval metrics: mean ± stderr, (paired) bootstrap, quantiles.

Every metric the gates judge is either a function of a (weighted) mean of per-item
values (accuracy = mean of 0/1, pass@1 = mean of per-problem pass@1, perplexity =
exp(mean NLL), KLD mean = mean of per-position KLD) or a quantile of per-item values
(KLD p99). So the bootstrap here resamples *means*, not arbitrary statistics: the caller
passes per-item values, optional per-item weights (tokens per window, for a perplexity
given as per-window mean NLLs) and a `transform` that turns the mean into the metric
(`np.exp` for perplexity). That keeps the whole bootstrap one vectorised gather.

Paired bootstrap: both models were scored on the same items, so each resample draws one
set of item indices and applies it to both arms. Item difficulty then cancels out of the
difference, which is what makes a 1-point MMLU drop detectable at all.

Large arrays (300k per-token KLD or NLL values): items are grouped into at most
`max_blocks` contiguous blocks and whole blocks are resampled (a moving-block-style
bootstrap with fixed, non-overlapping blocks). The cost is then n_boot × max_blocks
whatever n is, and because neighbouring tokens of one document are correlated, resampling
contiguous blocks gives a more honest (wider) interval than pretending tokens are
independent. With n ≤ max_blocks every item is its own block: the ordinary bootstrap.

Quantiles are not bootstrapped: `quantile_ci` uses the distribution-free order-statistic
interval (the ranks around n·q given by the normal approximation to the binomial).

CIs are percentile intervals at level 1 - alpha, seeded, so a report is reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from llmopt.errors import LlmoptError

Transform = Callable[[np.ndarray], np.ndarray]

DEFAULT_N_BOOT = 1000
DEFAULT_MAX_BLOCKS = 16384
# Rows of resample indices generated at once: bounds memory at ~_CHUNK_ELEMS int64s.
_CHUNK_ELEMS = 4_000_000


@dataclass
class Interval:
    estimate: float  # the statistic on the full data (not the mean of the resamples)
    low: float
    high: float
    n: int  # items
    block: int = 1  # items per resampled block (1 = ordinary bootstrap)


def as_values(values, name: str = "values") -> np.ndarray:
    """1-D float64 array of finite values, or LlmoptError saying what is wrong."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise LlmoptError(f"{name} must be a 1-D array of per-item values, got shape {arr.shape}")
    if arr.size == 0:
        raise LlmoptError(f"{name} is empty: no items were scored")
    if not np.all(np.isfinite(arr)):
        raise LlmoptError(f"{name} contains NaN or infinite values")
    return arr


def _as_weights(weights, n: int) -> np.ndarray | None:
    if weights is None:
        return None
    w = as_values(weights, "weights")
    if w.size != n:
        raise LlmoptError(f"weights has {w.size} entries for {n} items")
    if np.any(w < 0) or w.sum() <= 0:
        raise LlmoptError("weights must be non-negative and not all zero")
    return w


def _identity(x: np.ndarray) -> np.ndarray:
    return x


def mean_stderr(values) -> tuple[float, float]:
    """Mean and its standard error (sample std with ddof=1, over sqrt(n)).

    The stderr of one item is undefined: NaN rather than a misleading 0.
    """
    x = as_values(values)
    if x.size == 1:
        return float(x[0]), math.nan
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size))


def weighted_mean(values: np.ndarray, weights: np.ndarray | None) -> float:
    if weights is None:
        return float(values.mean())
    return float(np.dot(values, weights) / weights.sum())


def _blocks(arrays: list[np.ndarray], weights: np.ndarray | None, max_blocks: int) -> tuple[list[np.ndarray], np.ndarray, int]:
    """Per-block sums of w·x for each array, per-block sums of w, and the block size."""
    n = arrays[0].size
    size = max(1, math.ceil(n / max_blocks))
    starts = np.arange(0, n, size)
    w = np.ones(n) if weights is None else weights
    if size == 1:
        return [a * w for a in arrays], w, 1
    sums = [np.add.reduceat(a * w, starts) for a in arrays]
    return sums, np.add.reduceat(w, starts), size


def _resampled_means(sums: list[np.ndarray], wsum: np.ndarray, n_boot: int, seed: int) -> list[np.ndarray]:
    """n_boot bootstrap means per array; all arrays share the same resampled blocks."""
    k = wsum.size
    rng = np.random.default_rng(seed)
    out = [np.empty(n_boot) for _ in sums]
    rows = max(1, _CHUNK_ELEMS // k)
    for start in range(0, n_boot, rows):
        idx = rng.integers(0, k, size=(min(rows, n_boot - start), k))
        denom = wsum[idx].sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):  # a resample of zero-weight blocks only
            for o, s in zip(out, sums):
                o[start : start + idx.shape[0]] = s[idx].sum(axis=1) / denom
    return out


def _percentiles(stats: np.ndarray, alpha: float) -> tuple[float, float]:
    stats = stats[np.isfinite(stats)]
    if stats.size == 0:
        return math.nan, math.nan
    low, high = np.quantile(stats, [alpha / 2, 1 - alpha / 2])
    return float(low), float(high)


def _check(n_boot: int, alpha: float, max_blocks: int) -> None:
    if n_boot < 1:
        raise LlmoptError(f"n_boot must be >= 1, got {n_boot}")
    if not 0 < alpha < 1:
        raise LlmoptError(f"alpha must be in (0, 1), got {alpha}")
    if max_blocks < 1:
        raise LlmoptError(f"max_blocks must be >= 1, got {max_blocks}")


def bootstrap_ci(
    values,
    transform: Transform | None = None,
    *,
    weights=None,
    n_boot: int = DEFAULT_N_BOOT,
    seed: int = 0,
    alpha: float = 0.05,
    max_blocks: int = DEFAULT_MAX_BLOCKS,
) -> Interval:
    """CI of transform(weighted mean of values) by (block) bootstrap over items."""
    _check(n_boot, alpha, max_blocks)
    f = transform or _identity
    x = as_values(values)
    w = _as_weights(weights, x.size)
    estimate = float(f(np.asarray(weighted_mean(x, w))))
    (sums,), wsum, size = _blocks([x], w, max_blocks)
    (means,) = _resampled_means([sums], wsum, n_boot, seed)
    with np.errstate(all="ignore"):
        low, high = _percentiles(f(means), alpha)
    return Interval(estimate, low, high, x.size, size)


def paired_bootstrap_ci(
    base,
    cand,
    transform: Transform | None = None,
    *,
    relative: bool = False,
    weights=None,
    n_boot: int = DEFAULT_N_BOOT,
    seed: int = 0,
    alpha: float = 0.05,
    max_blocks: int = DEFAULT_MAX_BLOCKS,
) -> Interval:
    """CI of the change f(mean cand) - f(mean base), or f(cand)/f(base) - 1 if `relative`.

    `base` and `cand` are per-item values on the same items in the same order; each
    resample applies one set of item (block) indices to both. `weights` are per item and
    shared (both models saw the same tokens). Identical arrays give exactly [0, 0].
    """
    _check(n_boot, alpha, max_blocks)
    f = transform or _identity
    b = as_values(base, "baseline values")
    c = as_values(cand, "candidate values")
    if b.size != c.size:
        raise LlmoptError(f"paired values differ in length: baseline {b.size}, candidate {c.size} items")
    w = _as_weights(weights, b.size)

    def change(fb: np.ndarray, fc: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):
            return fc / fb - 1.0 if relative else fc - fb

    estimate = float(change(f(np.asarray(weighted_mean(b, w))), f(np.asarray(weighted_mean(c, w)))))
    (sb, sc), wsum, size = _blocks([b, c], w, max_blocks)
    mb, mc = _resampled_means([sb, sc], wsum, n_boot, seed)
    with np.errstate(all="ignore"):
        low, high = _percentiles(change(f(mb), f(mc)), alpha)
    return Interval(estimate, low, high, b.size, size)


def quantile_ci(values, q: float, *, alpha: float = 0.05) -> Interval:
    """The q-quantile of values with a distribution-free order-statistic CI.

    The number of values below the true quantile is Binomial(n, q); the CI is the pair of
    order statistics at ranks n·q ± z·sqrt(n·q·(1-q)) (normal approximation), clipped to
    the sample. Exact enough for the large per-position arrays it is meant for.
    """
    if not 0 <= q <= 1:
        raise LlmoptError(f"quantile must be in [0, 1], got {q}")
    if not 0 < alpha < 1:
        raise LlmoptError(f"alpha must be in (0, 1), got {alpha}")
    x = as_values(values)
    n = x.size
    z = NormalDist().inv_cdf(1 - alpha / 2)
    spread = z * math.sqrt(n * q * (1 - q))
    lo_rank = min(n - 1, max(0, math.floor(n * q - spread) - 1))  # ranks are 1-based
    hi_rank = min(n - 1, max(0, math.ceil(n * q + spread) - 1))
    part = np.partition(x, [lo_rank, hi_rank])
    estimate = float(np.quantile(x, q))
    return Interval(estimate, float(min(part[lo_rank], estimate)), float(max(part[hi_rank], estimate)), n)
