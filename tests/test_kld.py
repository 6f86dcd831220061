"""KLD statistics against a line-by-line re-implementation of llama.cpp's `kl_divergence()`.

The reference below follows tools/perplexity/perplexity.cpp (ggml-org/llama.cpp): the
per-token `log_softmax(..., kl_divergence_result &)` in float32 with double sums, then the
summary's `mean_and_uncertainty`, `covariance` and `percentile` lambdas. One deliberate
difference: llama.cpp stores the baseline's log-probs as uint16 (a per-row scale over the
top 16 nats); the reference takes them unrounded, as our store does.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from llmopt.eval.metrics.kld import STORE_DTYPE, kld_logprobs, position_stats, summarize


def _llama_cpp_summary(base_logits: np.ndarray, cand_logits: np.ndarray, tokens: np.ndarray) -> dict:
    n_vocab = base_logits.shape[1]
    s = dict(sum_nll=0.0, sum_nll2=0.0, sum_nll_base=0.0, sum_nll_base2=0.0, sum_nll_nll_base=0.0, sum_kld=0.0,
             sum_kld2=0.0, sum_p_diff=0.0, sum_p_diff2=0.0, sum_p_diff4=0.0, n_same_top=0, count=0)
    kld_values, p_diff_values = [], []
    for row_b, row, tok in zip(base_logits.astype(np.float32), cand_logits.astype(np.float32), tokens):
        # the baseline's log-probs, as the first pass would store them (unrounded here)
        mb = np.float32(row_b.max())
        base_lp = (row_b - mb - np.float32(math.log(sum(float(np.exp(np.float32(v - mb))) for v in row_b))))
        max_logit = np.float32(row[0])
        imax = 0
        for i in range(1, n_vocab):
            if row[i] > max_logit:
                max_logit, imax = np.float32(row[i]), i
        sum_exp = sum(float(np.exp(np.float32(row[i] - max_logit))) for i in range(n_vocab))
        log_sum_exp = np.float32(math.log(sum_exp))
        nll = np.float32(max_logit + log_sum_exp - row[tok])
        s["sum_nll"] += float(nll)
        s["sum_nll2"] += float(nll * nll)
        nll_base = np.float32(-base_lp[tok])
        s["sum_nll_base"] += float(nll_base)
        s["sum_nll_base2"] += float(nll_base * nll_base)
        s["sum_nll_nll_base"] += float(nll * nll_base)
        max_logit = np.float32(max_logit + log_sum_exp)
        total, imax_base, p_log_base_max = 0.0, -1, np.float32(0)
        for i in range(n_vocab):
            p_log_base = base_lp[i]
            if i == 0 or p_log_base > p_log_base_max:
                p_log_base_max, imax_base = p_log_base, i
            if p_log_base > -16.0:
                p_base = float(np.exp(p_log_base))
                total += p_base * float(p_log_base - row[i] + max_logit)
        s["sum_kld"] += total
        s["sum_kld2"] += total * total
        s["count"] += 1
        s["n_same_top"] += imax == imax_base
        p_diff = float(np.float32(np.exp(-nll) - np.exp(-nll_base)))
        s["sum_p_diff"] += p_diff
        s["sum_p_diff2"] += p_diff * p_diff
        s["sum_p_diff4"] += p_diff**4
        kld_values.append(np.float32(total))
        p_diff_values.append(p_diff)

    def mean_and_uncertainty(total, total2, count):
        f = total / count
        df = total2 / count - f * f
        return f, math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0

    def covariance(a, b, ab, count):
        return (ab / count - (a / count) * (b / count)) / (count - 1) if count >= 10 else 0.0

    def percentile(values, fraction):
        if fraction <= 0:
            return values[0]
        if fraction >= 1:
            return values[-1]
        p = fraction * (len(values) - 1)
        ip = int(p)
        p -= ip
        return (1 - p) * values[ip] + p * values[min(ip + 1, len(values) - 1)]

    def median(values):
        n = len(values)
        return 0.5 * (values[n // 2] + values[n // 2 - 1]) if n % 2 == 0 else values[n // 2]

    n = s["count"]
    kld_values, p_diff_values = sorted(kld_values), sorted(p_diff_values)
    log_ppl, log_ppl_unc = mean_and_uncertainty(s["sum_nll"], s["sum_nll2"], n)
    log_base, log_base_unc = mean_and_uncertainty(s["sum_nll_base"], s["sum_nll_base2"], n)
    cov = covariance(s["sum_nll"], s["sum_nll_base"], s["sum_nll_nll_base"], n)
    ppl, ppl_base = math.exp(log_ppl), math.exp(log_base)
    ratio_ln = log_ppl - log_base
    ratio_ln_unc = math.sqrt(log_ppl_unc**2 + log_base_unc**2 - 2 * cov)
    kld, kld_unc = mean_and_uncertainty(s["sum_kld"], s["sum_kld2"], n)
    dp, dp_unc = mean_and_uncertainty(s["sum_p_diff"], s["sum_p_diff2"], n)
    mse, mse_unc = mean_and_uncertainty(s["sum_p_diff2"], s["sum_p_diff4"], n)
    top = s["n_same_top"] / n
    out = {
        "ppl_cand": ppl, "ppl_cand_stderr": ppl * log_ppl_unc, "ppl_base": ppl_base,
        "ppl_base_stderr": ppl_base * log_base_unc, "ppl_correlation": cov / (log_ppl_unc * log_base_unc),
        "ln_ppl_ratio": ratio_ln, "ln_ppl_ratio_stderr": ratio_ln_unc, "ppl_ratio": math.exp(ratio_ln),
        "ppl_ratio_stderr": math.exp(ratio_ln) * ratio_ln_unc, "ppl_diff": ppl - ppl_base,
        "ppl_diff_stderr": math.sqrt((ppl * log_ppl_unc) ** 2 + (ppl_base * log_base_unc) ** 2 - 2 * ppl * ppl_base * cov),
        "mean": kld, "mean_stderr": kld_unc, "max": kld_values[-1], "median": median(kld_values), "min": kld_values[0],
        "rms_delta_p": math.sqrt(mse), "rms_delta_p_stderr": 0.5 / math.sqrt(mse) * mse_unc,
        "same_top_p": top, "same_top_p_stderr": math.sqrt(top * (1 - top) / (n - 1)),
        "delta_p": {"mean": dp, "mean_stderr": dp_unc, "max": p_diff_values[-1], "median": median(p_diff_values),
                    "min": p_diff_values[0]},
    }
    for q in (99.9, 99.0, 95.0, 90.0, 10.0, 5.0, 1.0, 0.1):
        out[f"p{q:g}"] = percentile(kld_values, q / 100)
    for q in (99.9, 99.0, 95.0, 90.0, 75.0, 25.0, 10.0, 5.0, 1.0, 0.1):
        out["delta_p"][f"p{q:g}"] = percentile(p_diff_values, q / 100)
    return out


def _ours(base_logits: torch.Tensor, cand_logits: torch.Tensor, tokens: torch.Tensor):
    base_lp = torch.log_softmax(base_logits, dim=-1)
    cand_lp = torch.log_softmax(cand_logits, dim=-1)
    nll_base = -base_lp.gather(1, tokens[:, None]).squeeze(1).double()
    nll_cand = -cand_lp.gather(1, tokens[:, None]).squeeze(1).double()
    kld, same, delta = position_stats(base_lp, cand_lp, nll_base, nll_cand)
    return summarize(kld.numpy(), same.numpy(), delta.numpy(), nll_base.numpy(), nll_cand.numpy())


def _streams(n: int = 400, vocab: int = 40, noise: float = 0.6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    base = 2.5 * torch.randn(n, vocab, generator=gen)
    cand = base + noise * torch.randn(n, vocab, generator=gen)
    # the observed next token: usually the baseline's favourite, sometimes any token
    tokens = torch.where(torch.rand(n, generator=gen) < 0.5, base.argmax(dim=1), torch.randint(0, vocab, (n,), generator=gen))
    return base, cand, tokens


def test_summary_matches_llama_cpp_formulas():
    base, cand, tokens = _streams()
    ours = _ours(base, cand, tokens).to_dict()
    ref = _llama_cpp_summary(base.numpy(), cand.numpy(), tokens.numpy())
    for key, want in ref.items():
        if key == "delta_p":
            for sub, w in want.items():
                assert ours["delta_p"][sub] == pytest.approx(w, rel=1e-4, abs=1e-6), f"delta_p.{sub}"
        else:
            assert ours[key] == pytest.approx(want, rel=1e-4, abs=1e-6), key
    assert ours["num_tokens"] == 400 and 0 < ours["same_top_p"] < 1 and ours["mean"] > 0.05


def test_delta_p_is_at_the_observed_token_not_the_baselines_top():
    base = torch.tensor([[4.0, 1.0, 0.0]])
    cand = torch.tensor([[3.0, 2.0, 0.0]])
    observed = torch.tensor([1])  # not the baseline's top token 0
    r = _ours(base.repeat(12, 1), cand.repeat(12, 1), observed.repeat(12))
    p = torch.softmax(cand[0], 0)[1] - torch.softmax(base[0], 0)[1]
    assert r.delta_p["mean"] == pytest.approx(p.item()) and p > 0  # the top token's own change would be < 0
    assert r.same_top_p == 1.0


def test_the_float16_store_reproduces_the_full_precision_kld():
    # what the baseline stores: hidden states and the vocabulary projection, float16
    gen = torch.Generator().manual_seed(2)
    hidden, vocab, n = 64, 3000, 300
    w_base = 0.15 * torch.randn(vocab, hidden, generator=gen)
    w_cand = w_base + 0.01 * torch.randn(vocab, hidden, generator=gen)  # a "quantized" projection
    h_base = 3.0 * torch.randn(n, hidden, generator=gen)
    h_cand = h_base + 0.2 * torch.randn(n, hidden, generator=gen)
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    exact = _ours((h_base.double() @ w_base.double().t()), (h_cand.double() @ w_cand.double().t()), tokens)
    base_lp = kld_logprobs(h_base.to(STORE_DTYPE), w_base.to(STORE_DTYPE))  # rebuilt from the store
    cand_lp = torch.log_softmax(h_cand @ w_cand.t(), dim=-1)  # the candidate's own float32 rows
    nll = torch.zeros(n, dtype=torch.float64)
    kld, same, _ = position_stats(base_lp, cand_lp, nll, nll)
    assert exact.mean > 0.03  # a real difference to reproduce
    assert kld.mean().item() == pytest.approx(exact.mean, rel=2e-3)
    assert np.quantile(kld.numpy(), 0.99) == pytest.approx(exact.percentiles["p99"], rel=1e-2)
    assert same.double().mean().item() == pytest.approx(exact.same_top_p, abs=2 / n)
    # against itself: only the store's rounding, tiny beside any difference a gate looks at
    self_kld, self_same, _ = position_stats(base_lp, torch.log_softmax(h_base @ w_base.t(), dim=-1), nll, nll)
    assert 0 <= self_kld.mean().item() < 1e-5 and self_same.double().mean() >= 0.99


def test_topk_kld_is_a_lower_bound_and_exact_when_the_known_tokens_hold_all_the_mass():
    """An endpoint's KLD from the candidate's top-k + a tail bucket (kld.topk_position_stats)."""
    from llmopt.eval.metrics.kld import topk_position_stats

    gen = torch.Generator().manual_seed(0)
    vocab, rows = 50, 40
    base = torch.log_softmax(2 * torch.randn(rows, vocab, generator=gen), -1)
    cand = torch.log_softmax(base + torch.randn(rows, vocab, generator=gen), -1)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    nll_b, nll_c = -base.gather(1, targets[:, None]).squeeze(1), -cand.gather(1, targets[:, None]).squeeze(1)
    full, same, delta = position_stats(base, cand, nll_b, nll_c)
    everything = torch.arange(vocab).repeat(rows, 1)
    exact, same_all, _ = topk_position_stats(base, everything, cand, nll_b, nll_c)
    assert torch.allclose(exact, full, atol=1e-9) and torch.equal(same_all, same)
    previous = torch.zeros(rows, dtype=torch.float64)
    for k in (1, 5, 20):  # more known tokens: a finer partition, never a smaller KLD
        values, ids = cand.topk(k, dim=1)
        approx, same_k, delta_k = topk_position_stats(base, ids, values, nll_b, nll_c)
        assert torch.all(approx <= full + 1e-9) and torch.all(approx >= previous - 1e-9)
        assert torch.equal(same_k, same) and torch.allclose(delta_k, delta)
        previous = approx
    assert previous.mean() > 0.5 * full.mean()
    # padding (-1) is ignored: the same known tokens padded give the same values
    values, ids = cand.topk(5, dim=1)
    padded_ids = torch.cat([ids, torch.full((rows, 3), -1)], 1)
    padded_values = torch.cat([values, torch.zeros(rows, 3)], 1)
    assert torch.allclose(topk_position_stats(base, padded_ids, padded_values, nll_b, nll_c)[0],
                          topk_position_stats(base, ids, values, nll_b, nll_c)[0])
