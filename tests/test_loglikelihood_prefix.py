"""Log-likelihoods of sequences that share a prefix (MMLU's subject header): the prefix runs once and the
rest attends to it, with the same results as running every sequence whole."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from llmopt.eval.metrics import loglikelihood as ll
from llmopt.kernels import cpu_prefill_attention
from llmopt.kernels.paged_attention import attend, prefill_mask


def _saved(runs, common, min_shared):
    return sum((hi - lo - 1) * shared for lo, hi, shared in runs if shared >= min_shared)


def _best_by_brute_force(common, min_shared):
    """The most tokens any partition of the sorted sequences into contiguous runs saves."""
    n, best = len(common) + 1, 0
    for cuts in itertools.product([False, True], repeat=n - 1):
        saved, lo = 0, 0
        for i in range(n):
            if i == n - 1 or cuts[i]:
                shared = min(common[lo:i]) if i > lo else 0
                saved += (i - lo) * shared if shared >= min_shared else 0
                lo = i + 1
        best = max(best, saved)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_prefix_groups_partition_and_save_the_most(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    common = [rng.choice([0, 3, 8, 9, 12, 20, 40]) for _ in range(n - 1)]
    runs = ll.prefix_groups(common, min_shared=8)
    covered = [i for lo, hi, _ in runs for i in range(lo, hi)]
    assert covered == list(range(n))  # a partition into contiguous runs, in order
    for lo, hi, shared in runs:
        assert shared == 0 or (hi - lo > 1 and shared >= 8 and shared == min(common[lo:hi - 1]))
    assert _saved(runs, common, 8) == _best_by_brute_force(common, 8)


def test_prefix_groups_of_subjects():
    # two subjects of three questions (headers of 20 tokens, the same first 15), a lone question
    common = [20, 20, 15, 20, 20, 0]
    assert ll.prefix_groups(common, 8) == [(0, 3, 20), (3, 6, 20), (6, 7, 0)]


def _random_qkv(seq_lens, gen):
    total = sum(seq_lens)
    return torch.randn(total, 4, 16, generator=gen), torch.randn(total, 2, 16, generator=gen), \
        torch.randn(total, 2, 16, generator=gen)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_packed_attention_with_a_prefix_is_attention_over_the_whole_sequence(use_kernel, monkeypatch):
    if use_kernel and cpu_prefill_attention.prefill_attention_kernel() is None:
        pytest.skip("the CPU kernels could not be built here (no g++/ninja)")
    if not use_kernel:
        monkeypatch.setattr(cpu_prefill_attention, "prefill_attention_kernel", lambda: None)
    gen = torch.Generator().manual_seed(0)
    seq_lens, prefix_of = [7, 5, 9, 4, 6], [-1, 0, 0, -1, 3]  # 7 shared by two, 4 by one
    q, k, v = _random_qkv(seq_lens, gen)
    got = ll.PackedAttention(seq_lens, prefix_of).forward(0, q, k, v, None)
    starts = [0, 7, 12, 21, 25]
    for i, (start, n, p) in enumerate(zip(starts, seq_lens, prefix_of)):
        rows = list(range(starts[p], starts[p] + seq_lens[p])) if p >= 0 else []
        rows += list(range(start, start + n))
        ctx = len(rows) - n
        expected = attend(q[rows][ctx:], k[rows], v[rows], prefill_mask(n, ctx, None, q.device))
        torch.testing.assert_close(got[start:start + n], expected, rtol=1e-5, atol=1e-5)


def _top2_margin(model, job) -> float:
    with torch.inference_mode():
        hidden = model(torch.tensor(job.ids), torch.arange(len(job.ids)), ll.PackedAttention([len(job.ids)]))
        top = model.compute_logits(hidden[-1:]).float().topk(2).values[0]
    return float(top[0] - top[1])


def test_sharing_prefixes_scores_as_running_every_sequence_whole(tiny_models):
    from llmopt.loader import load

    loaded = load(str(tiny_models["llama"]))
    header = "The following are multiple choice questions (with answers) about "
    contexts = [header + f"{subject}.\n\nQuestion {i}: what is {i} + {subject}?\nAnswer:"
                for subject in ("physics", "law", "art") for i in range(4)] + ["A lone context:"]
    contexts.append(contexts[0] + " Think first.")  # contexts[0] is all prefix of this one: no rest of its own
    pairs = [(c, cont) for c in contexts for cont in (" A", " B", " C", " D")]
    jobs, _ = ll.plan_jobs(loaded.tokenizer, pairs, loaded.config.max_position_embeddings)
    units = ll.plan_units(jobs, 2048)
    assert sum(u.num_tokens for u in units) < sum(len(j.ids) for j in jobs)  # something is shared
    assert sorted(id(j) for u in units for j in u.jobs) == sorted(id(j) for j in jobs)
    assert any(len(j.ids) == u.shared for u in units for j in u.jobs)  # a job that is its group's prefix
    shared, shared_greedy = ll.run_jobs(loaded.model, jobs, len(pairs))
    whole, whole_greedy = ll.run_jobs(loaded.model, jobs, len(pairs), min_shared_prefix=None)
    torch.testing.assert_close(torch.tensor(shared), torch.tensor(whole), rtol=1e-5, atol=1e-4)
    # is_greedy compared where the scored row's top two logits are >= 1e-3 apart (a nearer tie may fall either way)
    clear = [_top2_margin(loaded.model, job) >= 1e-3 for job in jobs]
    for job, ok in zip(jobs, clear):
        for pair, _, _ in job.scores:
            assert not ok or shared_greedy[pair] == whole_greedy[pair]
    assert sum(clear) >= len(jobs) // 2  # the check still looks at most of them
    # a batch too small for a whole group splits it; the prefix then runs once per piece
    small, _ = ll.run_jobs(loaded.model, jobs, len(pairs), batch_tokens=120)
    torch.testing.assert_close(torch.tensor(small), torch.tensor(whole), rtol=1e-5, atol=1e-4)
