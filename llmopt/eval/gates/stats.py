"""Confidence intervals for eval metrics: one stderr, one (paired, block) bootstrap.

Every metric the gates judge is a function of a (weighted) mean of per-item values
(accuracy = mean of 0/1, pass@1 = mean of per-problem pass@1, perplexity = exp(mean
NLL), KLD mean = mean of per-position KLD) or a quantile of per-item values (KLD p99).
The caller passes per-item values, optional per-item weights and a `transform` that turns
the mean into the metric (`np.exp` for perplexity), or a `quantile`.

The bootstrap is the circular block bootstrap (Politis & Romano 1992): a resample is
ceil(n / b) blocks of b consecutive items, each starting anywhere in the series and
wrapping around its end. With b = 1 that is the ordinary bootstrap (independent items:
MMLU questions, HumanEval problems). Neighbouring tokens of one text are correlated, so
token-level metrics (perplexity, KLD) always use blocks, of length `token_block(n)` =
round(n^(1/3)) (the order that minimises the error of the block bootstrap's variance
estimate, Hall, Horowitz & Jing 1995): 16 tokens at 4,096 scored tokens, 67 at 300k.

Paired bootstrap: both models were scored on the same items, so each resample draws one
set of block starts and applies it to both arms. Item difficulty then cancels out of the
difference, which is what makes a 1-point MMLU drop detectable at all.

No interval below `MIN_UNITS` resampled units (items, or blocks for token-level
metrics): a percentile bootstrap of a handful of values says little about the
population, and one item gives the degenerate interval [x, x]. The `Interval` then has
`low = high = None` and a `reason`.

CIs are percentile intervals at level 1 - alpha, seeded, so a report is reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from llmopt.errors import LlmoptError

Transform = Callable[[np.ndarray], np.ndarray]

DEFAULT_N_BOOT = 1000
MIN_UNITS = 30  # fewer items (blocks) than this: no interval, never "significant"
# Resampled values held at once: bounds memory at ~_CHUNK_ELEMS float64s.
_CHUNK_ELEMS = 4_000_000


@dataclass
class Interval:
    estimate: float  # the statistic on the full data (not the mean of the resamples)
    low: float | None  # None: too few items for an interval (see `reason`)
    high: float | None
    n: int  # items
    block: int = 1  # items per resampled block (1 = ordinary bootstrap)
    reason: str = ""  # why there is no interval

    @property
    def units(self) -> int:
        """Blocks per resample: the effective sample size the bootstrap sees."""
        return math.ceil(self.n / self.block)

    @property
    def exists(self) -> bool:
        return self.low is not None and self.high is not None


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
    """Mean and its standard error (sample std with ddof=1, over sqrt(n)), lm-eval's `mean_stderr`.

    The stderr of one item is undefined: NaN rather than a misleading 0.
    """
    x = as_values(values)
    if x.size == 1:
        return float(x[0]), math.nan
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size))


def stderr(values) -> float | None:
    """`mean_stderr`'s standard error, None where undefined (one item): for JSON reports."""
    se = mean_stderr(values)[1]
    return None if math.isnan(se) else se


def weighted_mean(values: np.ndarray, weights: np.ndarray | None) -> float:
    if weights is None:
        return float(values.mean())
    return float(np.dot(values, weights) / weights.sum())


def token_block(n: int) -> int:
    """Block length for token-level metrics: round(n^(1/3)), at least 1."""
    return max(1, round(n ** (1 / 3)))


def _circular_sums(x: np.ndarray, block: int) -> np.ndarray:
    """sum(x[s : s + block]) for every start s, wrapping around the end."""
    if block == 1:
        return x
    ext = np.concatenate([[0.0], np.cumsum(np.concatenate([x, x[: block - 1]]))])
    return ext[block:] - ext[:-block]


def _starts(rng: np.random.Generator, n: int, units: int, rows: int) -> np.ndarray:
    return rng.integers(0, n, size=(rows, units))


def _resampled_means(arrays: list[np.ndarray], weights: np.ndarray | None, block: int, n_boot: int,
                     seed: int) -> list[np.ndarray]:
    """n_boot bootstrap weighted means per array; all arrays share the same resampled blocks."""
    n = arrays[0].size
    units = math.ceil(n / block)
    w = np.ones(n) if weights is None else weights
    sums = [_circular_sums(a * w, block) for a in arrays]
    wsums = _circular_sums(w, block)
    rng = np.random.default_rng(seed)
    out = [np.empty(n_boot) for _ in arrays]
    rows = max(1, _CHUNK_ELEMS // units)
    for start in range(0, n_boot, rows):
        idx = _starts(rng, n, units, min(rows, n_boot - start))
        denom = wsums[idx].sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):  # a resample of zero-weight blocks only
            for o, s in zip(out, sums):
                o[start : start + idx.shape[0]] = s[idx].sum(axis=1) / denom
    return out


def _resampled_quantiles(x: np.ndarray, q: float, block: int, n_boot: int, seed: int) -> np.ndarray:
    n = x.size
    units = math.ceil(n / block)
    rng = np.random.default_rng(seed)
    out = np.empty(n_boot)
    offsets = np.arange(block)
    rows = max(1, _CHUNK_ELEMS // (units * block))
    for start in range(0, n_boot, rows):
        idx = _starts(rng, n, units, min(rows, n_boot - start))
        items = (idx[:, :, None] + offsets).reshape(idx.shape[0], -1) % n
        out[start : start + idx.shape[0]] = np.quantile(x[items], q, axis=1)
    return out


def _percentiles(values: np.ndarray, alpha: float) -> tuple[float, float]:
    values = values[np.isfinite(values)]
    if values.size == 0:
        return math.nan, math.nan
    low, high = np.quantile(values, [alpha / 2, 1 - alpha / 2])
    return float(low), float(high)


def _check(n_boot: int, alpha: float, block: int) -> None:
    if n_boot < 1:
        raise LlmoptError(f"the number of bootstrap samples must be >= 1, got {n_boot}")
    if not 0 < alpha < 1:
        raise LlmoptError(f"alpha must be in (0, 1), got {alpha}")
    if block < 1:
        raise LlmoptError(f"block length must be >= 1, got {block}")


def _too_few(estimate: float, n: int, block: int) -> Interval | None:
    units = math.ceil(n / block)
    if units >= MIN_UNITS:
        return None
    what = f"{units} blocks of {block} items" if block > 1 else f"{n} items"
    return Interval(estimate, None, None, n, block, f"{what}: below the minimum of {MIN_UNITS} for an interval")


def bootstrap_ci(
    values,
    transform: Transform | None = None,
    *,
    weights=None,
    quantile: float | None = None,
    block: int = 1,
    n_boot: int = DEFAULT_N_BOOT,
    seed: int = 0,
    alpha: float = 0.05,
) -> Interval:
    """CI of transform(weighted mean of values), or of their `quantile`, by (block) bootstrap."""
    _check(n_boot, alpha, block)
    x = as_values(values)
    w = _as_weights(weights, x.size)
    if quantile is not None:
        if transform is not None or w is not None:
            raise LlmoptError("a quantile takes neither transform nor weights")
        if not 0 <= quantile <= 1:
            raise LlmoptError(f"quantile must be in [0, 1], got {quantile}")
        estimate = float(np.quantile(x, quantile))
        if (none := _too_few(estimate, x.size, block)) is not None:
            return none
        low, high = _percentiles(_resampled_quantiles(x, quantile, block, n_boot, seed), alpha)
        return Interval(estimate, low, high, x.size, block)
    f = transform or _identity
    estimate = float(f(np.asarray(weighted_mean(x, w))))
    if (none := _too_few(estimate, x.size, block)) is not None:
        return none
    (means,) = _resampled_means([x], w, block, n_boot, seed)
    with np.errstate(all="ignore"):
        low, high = _percentiles(f(means), alpha)
    return Interval(estimate, low, high, x.size, block)


def paired_bootstrap_ci(
    base,
    cand,
    transform: Transform | None = None,
    *,
    relative: bool = False,
    weights=None,
    block: int = 1,
    n_boot: int = DEFAULT_N_BOOT,
    seed: int = 0,
    alpha: float = 0.05,
) -> Interval:
    """CI of the change f(mean cand) - f(mean base), or f(cand)/f(base) - 1 if `relative`.

    `base` and `cand` are per-item values on the same items in the same order; each
    resample applies one set of block starts to both. `weights` are per item and shared
    (both models saw the same tokens). Identical arrays give exactly [0, 0].
    """
    _check(n_boot, alpha, block)
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
    if (none := _too_few(estimate, b.size, block)) is not None:
        return none
    mb, mc = _resampled_means([b, c], w, block, n_boot, seed)
    with np.errstate(all="ignore"):
        low, high = _percentiles(change(f(mb), f(mc)), alpha)
    return Interval(estimate, low, high, b.size, block)
