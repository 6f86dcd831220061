"""KL divergence of a candidate from its baseline, with the statistics llama.cpp's
`llama-perplexity --kl-divergence` prints (tools/perplexity/perplexity.cpp), so the
numbers set side by side with llama.cpp's published tables.

Per scored position (`position_stats`), as llama.cpp computes them:
  * KLD = sum_i p_base(i) (log p_base(i) - log p_cand(i)), over tokens with
    log p_base(i) > -16 (llama.cpp's cut-off);
  * same top: the two models' most likely tokens agree;
  * Δp = p_cand(t) - p_base(t) at the observed next token t;
  * both models' NLL of t.

The baseline side is stored as what its logits are made of, not as the logits: per scored
token its final hidden state (float16, hidden_size x 2 bytes), plus once its vocabulary
projection as a dense float16 matrix (read off the model: lm_head applied to the identity,
so an int4 lm_head stores what it computes). The candidate pass rebuilds the baseline's
full log-softmax rows from them where llama.cpp would read its file, and compares them
with its own float32 rows. The rounding costs ~1e-6 nats of KLD on the default model (a
model against itself reads ~1e-6, not 0); the baseline pass measures it on every run
(`BaselineStore.error`, in the report). A projection that rounds its input as well (an
int8 copy of the weights, which quantizes activations) is rebuilt without that rounding:
the measured error says how much that moves. Sizes: 1.1 KiB per scored token for the default model
(hidden 576) + 54 MiB once for its 49k x 576 projection, 59 MiB in all at the default
4,080 tokens (the full float16 rows took 383 MiB); a 7B Llama (hidden 4096, 32k vocabulary)
8 KiB per token + 250 MiB once, where llama.cpp's `--kl-divergence-base` file holds
64 KiB per token (users report 11 GiB files for 7B models). Storing the top 256
log-probs instead (2 KiB per token) under-states this 135M model's KLD by 8% (top 1024:
3%): its tails are too heavy for a top-k store (docs/benchmarks.md).

The summary (`summarize`) follows `kl_divergence()` in perplexity.cpp line by line:
mean ± uncertainty (sqrt((mean(x²) - mean(x)²) / (n - 1)), 0 at n <= 10), the KLD
percentiles 99.9 ... 0.1 with max/min (linear interpolation between sorted values), the
same for Δp (plus 75/25), RMS Δp ± (0.5 / rms · uncertainty of the mean of Δp²), same top
p ± sqrt(p(1-p)/(n-1)), PPL(Q) and PPL(base) ±, their correlation, ln(PPL(Q)/PPL(base)) ±
and the ratio ±, PPL(Q) - PPL(base) ±. These ± treat tokens as independent, as llama.cpp
does; the gates use a block bootstrap instead (`stats.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

LOG_P_FLOOR = -16.0  # llama.cpp sums only terms with log p_base above this
KLD_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 10.0, 5.0, 1.0, 0.1)  # plus max, median, min
DELTA_P_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 25.0, 10.0, 5.0, 1.0, 0.1)
STORE_DTYPE = torch.float16


@dataclass
class BaselineStore:
    """What the baseline pass keeps for KLD: its rows' ingredients, rounded to float16."""

    hidden: np.ndarray  # [scored tokens, hidden_size]: final hidden states (after the last norm)
    lm_head: np.ndarray  # [vocab, hidden_size]: the dense vocabulary projection
    error: float = 0.0  # mean KLD(rebuilt rows || own rows): what the rounding costs, = the model against itself

    @property
    def nbytes(self) -> int:
        return int(self.hidden.nbytes + self.lm_head.nbytes)

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.shape[0])


@torch.inference_mode()
def dense_lm_head(model) -> torch.Tensor:
    """The model's vocabulary projection as a dense [vocab, hidden] matrix in STORE_DTYPE: lm_head(identity)."""
    p = next(model.parameters())
    hidden_size = model.config.hidden_size
    eye = torch.eye(hidden_size, dtype=p.dtype if p.is_floating_point() else torch.float32, device=p.device)
    return model.compute_logits(eye).t().contiguous().to(STORE_DTYPE)


@dataclass
class RowBuffers:
    """float32 [rows, vocab] buffers for `kld_logprobs` (the rebuilt rows; the product, in the first work buffer) and
    `position_stats` (both work buffers), so that a pass over thousands of rows computes in the same memory each
    time instead of allocating vocabulary-sized temporaries per block (50 MB each for 256 rows of the default
    model: fresh pages every time, each page a fault)."""

    rows: torch.Tensor
    work: tuple[torch.Tensor, torch.Tensor]

    @classmethod
    def allocate(cls, rows: int, vocab: int, device: torch.device) -> RowBuffers:
        new = lambda: torch.empty(rows, vocab, dtype=torch.float32, device=device)  # noqa: E731
        return cls(new(), (new(), new()))

    def take(self, rows: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The first `rows` rows of the rows buffer and of the two work buffers."""
        return self.rows[:rows], (self.work[0][:rows], self.work[1][:rows])


def kld_logprobs(hidden: torch.Tensor, lm_head: torch.Tensor, out: torch.Tensor | None = None,
                 work: torch.Tensor | None = None) -> torch.Tensor:
    """float32 log-softmax rows rebuilt from float16-rounded hidden states and projection (`lm_head` as stored, or
    already widened to float32: the same values); into `out` where given, the products in `work`."""
    h, w = hidden.to(STORE_DTYPE).float(), lm_head.float().t()
    if out is None:
        return torch.log_softmax(h @ w, dim=-1)
    return torch.log_softmax(torch.mm(h, w, out=work), dim=-1, out=out)


def _kld_terms(p_log: torch.Tensor, q_log: torch.Tensor, work: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> torch.Tensor:
    """Row sums (float64) of p (log p - log q) over the entries with log p > -16 (llama.cpp's cut-off); the terms
    in the inputs' dtype (float32 rows: each term within a few ulps, the sums over a vocabulary in float64);
    computed in the two `work` tensors (p_log's shape) where given."""
    if work is None:
        terms = p_log.exp().mul_(p_log - q_log)
    else:
        terms = torch.exp(p_log, out=work[0]).mul_(torch.sub(p_log, q_log, out=work[1]))
    return terms.masked_fill_(p_log <= LOG_P_FLOOR, 0).sum(dim=1, dtype=torch.float64)


def _delta_p(nll_base: torch.Tensor, nll_cand: torch.Tensor) -> torch.Tensor:
    return torch.exp(-nll_cand.double()) - torch.exp(-nll_base.double())


def position_stats(base_logprobs: torch.Tensor, cand_logprobs: torch.Tensor, nll_base: torch.Tensor,
                   nll_cand: torch.Tensor, work: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row, as llama.cpp: KLD(base || cand) over tokens with log p_base > -16, same top (0/1), Δp at the observed
    token; `work`: two tensors of the rows' shape to compute the KLD terms in (else allocated)."""
    kld = _kld_terms(base_logprobs, cand_logprobs, work)
    same = (cand_logprobs.argmax(dim=1) == base_logprobs.argmax(dim=1)).to(torch.int32)
    return kld, same, _delta_p(nll_base, nll_cand)


TAIL_FLOOR = 1e-12  # a bucket's mass below this (rounding in a server's top-k) counts as this


def topk_position_stats(base_logprobs: torch.Tensor, cand_ids: torch.Tensor, cand_logprobs: torch.Tensor,
                        nll_base: torch.Tensor, nll_cand: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`position_stats` when the candidate is known only by its top-k log-probs (an OpenAI endpoint).

    `cand_ids`/`cand_logprobs` [n, K]: the candidate's known tokens per row (its top-k and the
    observed token; id -1 pads). KLD is computed exactly for the distributions coarsened to
    those K tokens plus one bucket holding the rest of each side's mass (the tail: 1 - the
    known tokens' probabilities), with llama.cpp's -16 cut-off applied to every bucket. By the
    log-sum inequality a coarsened KLD never exceeds the full one: this is a lower bound, equal
    to the full KLD when the known tokens hold all of both distributions' mass. Δp is exact
    (it reads the observed token's probabilities); same top takes the candidate's most likely
    known token, exact whenever its top token is among the known ones.
    """
    p_all = base_logprobs.double()
    known = cand_ids >= 0
    ids = cand_ids.clamp(min=0)
    q_log = torch.where(known, cand_logprobs.double(), torch.full_like(cand_logprobs, -math.inf, dtype=torch.float64))
    p_log = torch.where(known, p_all.gather(1, ids), torch.full_like(q_log, -math.inf))
    p_rest = (1 - p_log.exp().sum(dim=1)).clamp(min=TAIL_FLOOR)
    q_rest = (1 - q_log.exp().sum(dim=1)).clamp(min=TAIL_FLOOR)
    kld = _kld_terms(torch.cat([p_log, p_rest.log()[:, None]], 1), torch.cat([q_log, q_rest.log()[:, None]], 1))
    cand_top = ids.gather(1, q_log.argmax(dim=1, keepdim=True)).squeeze(1)
    same = (cand_top == base_logprobs.argmax(dim=1)).to(torch.int32)
    return kld, same, _delta_p(nll_base, nll_cand)


def mean_and_uncertainty(values: np.ndarray) -> tuple[float, float]:
    """llama.cpp's `mean_and_uncertainty`: mean, sqrt((mean(x²) - mean²) / (n - 1)), 0 when n <= 10."""
    x = np.asarray(values, dtype=np.float64)
    n = x.size
    if n < 1:
        return 0.0, 0.0
    f = float(x.sum() / n)
    df = float((x * x).sum() / n - f * f)
    return f, math.sqrt(df / (n - 1)) if df > 0 and n > 10 else 0.0


def _covariance(a: np.ndarray, b: np.ndarray) -> float:
    """llama.cpp's `covariance` of the two means: (mean(ab) - mean(a)mean(b)) / (n - 1), 0 when n < 10."""
    n = a.size
    if n < 10:
        return 0.0
    return float(((a * b).sum() / n - (a.sum() / n) * (b.sum() / n)) / (n - 1))


def _percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama.cpp's `percentile`: linear interpolation between sorted values (numpy's default quantile)."""
    return float(np.quantile(sorted_values, fraction))


def _distribution(values: np.ndarray, percentiles: tuple[float, ...]) -> dict[str, float]:
    s = np.sort(values)
    out = {"max": float(s[-1])}
    for q in percentiles:
        if q < 50 and "median" not in out:
            out["median"] = float(np.median(s))
        out[f"p{q:g}"] = _percentile(s, q / 100)
    out["min"] = float(s[0])
    return out


@dataclass
class KLDResult:
    """llama.cpp's KLD summary, plus the per-position values gates and sample logs use."""

    mean: float
    mean_stderr: float
    percentiles: dict[str, float]  # max, p99.9, p99, p95, p90, median, p10, p5, p1, p0.1, min
    delta_p: dict[str, float]  # mean, mean_stderr, max, p99.9 ... p0.1, min (fractions, not %)
    rms_delta_p: float
    rms_delta_p_stderr: float
    same_top_p: float
    same_top_p_stderr: float
    ppl_base: float
    ppl_base_stderr: float
    ppl_cand: float
    ppl_cand_stderr: float
    ppl_correlation: float  # Cor(ln PPL(Q), ln PPL(base)) as llama.cpp prints it
    ln_ppl_ratio: float
    ln_ppl_ratio_stderr: float
    ppl_ratio: float
    ppl_ratio_stderr: float
    ppl_diff: float
    ppl_diff_stderr: float
    num_tokens: int
    per_position: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    same_top: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0, dtype=np.int32))
    delta_p_values: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in ("mean", "mean_stderr")}
        out.update(self.percentiles)
        out["delta_p"] = dict(self.delta_p)
        for k in ("rms_delta_p", "rms_delta_p_stderr", "same_top_p", "same_top_p_stderr", "ppl_base", "ppl_base_stderr",
                  "ppl_cand", "ppl_cand_stderr", "ppl_correlation", "ln_ppl_ratio", "ln_ppl_ratio_stderr", "ppl_ratio",
                  "ppl_ratio_stderr", "ppl_diff", "ppl_diff_stderr", "num_tokens"):
            out[k] = getattr(self, k)
        return out


def summarize(kld: np.ndarray, same: np.ndarray, delta_p: np.ndarray, nll_base: np.ndarray,
              nll_cand: np.ndarray) -> KLDResult:
    kld, delta_p = np.asarray(kld, np.float64), np.asarray(delta_p, np.float64)
    nll_base, nll_cand = np.asarray(nll_base, np.float64), np.asarray(nll_cand, np.float64)
    n = kld.size
    log_ppl, log_ppl_unc = mean_and_uncertainty(nll_cand)
    log_base, log_base_unc = mean_and_uncertainty(nll_base)
    cov = _covariance(nll_cand, nll_base)
    ppl, ppl_base = math.exp(log_ppl), math.exp(log_base)
    ppl_unc, ppl_base_unc = ppl * log_ppl_unc, ppl_base * log_base_unc
    denom = log_ppl_unc * log_base_unc
    ratio_ln = log_ppl - log_base
    ratio_ln_unc = math.sqrt(max(0.0, log_ppl_unc**2 + log_base_unc**2 - 2.0 * cov))
    diff_unc = math.sqrt(max(0.0, ppl_unc**2 + ppl_base_unc**2 - 2.0 * ppl * ppl_base * cov))
    mse, mse_unc = mean_and_uncertainty(delta_p**2)
    rms = math.sqrt(mse)
    dp_mean, dp_unc = mean_and_uncertainty(delta_p)
    top = float(np.mean(same))
    mean, mean_unc = mean_and_uncertainty(kld)
    return KLDResult(
        mean=mean, mean_stderr=mean_unc,
        percentiles=_distribution(kld, KLD_PERCENTILES),
        delta_p={"mean": dp_mean, "mean_stderr": dp_unc, **_distribution(delta_p, DELTA_P_PERCENTILES)},
        rms_delta_p=rms, rms_delta_p_stderr=0.5 / rms * mse_unc if rms > 0 else 0.0,
        same_top_p=top, same_top_p_stderr=math.sqrt(top * (1 - top) / (n - 1)) if n > 1 else 0.0,
        ppl_base=ppl_base, ppl_base_stderr=ppl_base_unc, ppl_cand=ppl, ppl_cand_stderr=ppl_unc,
        ppl_correlation=cov / denom if denom > 0 else math.nan,
        ln_ppl_ratio=ratio_ln, ln_ppl_ratio_stderr=ratio_ln_unc,
        ppl_ratio=math.exp(ratio_ln), ppl_ratio_stderr=math.exp(ratio_ln) * ratio_ln_unc,
        ppl_diff=ppl - ppl_base, ppl_diff_stderr=diff_unc,
        num_tokens=n,
        per_position=kld, same_top=np.asarray(same, np.int32), delta_p_values=delta_p,
    )  # fmt: skip
