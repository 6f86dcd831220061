"""Speculative decoding: greedy output identical to plain decoding for both proposers (chunked
prefill, prefix caching, preemption), the target's distribution kept under sampling, KV rollback,
stops inside an accepted run, structured outputs, metrics, and the draft/target tokenizer check."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from conftest import make_byte_tokenizer, write_tiny_model
from test_runtime_exactness import CONFIGS, tiny_prompts

from llmopt.loader import load
from llmopt.errors import LlmoptError
from llmopt.runtime import SamplingParams
from llmopt.runtime.llm import LLM
from llmopt.runtime.proposers import find_continuation
from llmopt.runtime.sampler import SampleRequest, verify_row
from llmopt.runtime.speculative import SpeculativeConfig

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return load(str(tiny_models["llama"]), dtype="float32")


@pytest.fixture(scope="module")
def poor_draft(tmp_path_factory):
    """Same tokenizer and shape as the tiny llama, other random weights: most proposals are rejected."""
    return write_tiny_model(tmp_path_factory.mktemp("draft") / "llama", "llama", seed=1)


@pytest.fixture(scope="module")
def plain_tokens(tiny):
    llm = LLM(tiny, max_num_seqs=16, num_kv_blocks=512)
    return [o.outputs[0].token_ids for o in llm.generate(tiny_prompts(), GREEDY)]


def spec_run(loaded, spec, prompts, params=GREEDY, **config):
    llm = LLM(loaded, max_num_seqs=16, speculative_config=spec, **config)
    outs = llm.generate(prompts, params)
    return outs, llm.engine


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("proposer", ["ngram", "self-draft", "poor-draft"])
def test_greedy_speculation_equals_plain_decoding(tiny, tiny_models, poor_draft, plain_tokens, name, proposer):
    spec = {"ngram": dict(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1),
            "self-draft": dict(model=str(tiny_models["llama"]), num_speculative_tokens=3),
            "poor-draft": dict(model=str(poor_draft), num_speculative_tokens=3)}[proposer]
    outs, engine = spec_run(tiny, spec, tiny_prompts(), **CONFIGS[name])
    assert [o.outputs[0].token_ids for o in outs] == plain_tokens
    stats = engine.stats()
    s = stats.spec_decode
    assert s["num_drafts"] > 0 and s["num_draft_tokens"] >= s["num_drafts"]
    if proposer == "self-draft":  # the target drafting for itself: every proposal accepted
        assert s["num_accepted_tokens"] == s["num_draft_tokens"]
    elif proposer == "ngram":  # random models repeat themselves: some proposals land
        assert 0 < s["num_accepted_tokens"] < s["num_draft_tokens"]
    else:
        assert s["num_accepted_tokens"] < s["num_draft_tokens"] / 4
    assert sum(s["num_accepted_tokens_per_pos"]) == s["num_accepted_tokens"]
    if name == "preemption":
        assert stats.num_preemptions > 0
    # no leak: rolled-back and trimmed blocks all went back to the pool
    assert stats.kv_cache_usage_perc == 0.0 and stats.num_requests_running == 0
    # per request counters add up to the engine's
    assert sum(o.metrics.spec_num_drafts for o in outs) == s["num_drafts"]
    assert sum(o.metrics.spec_num_accepted_tokens for o in outs) == s["num_accepted_tokens"]
    assert s["mean_acceptance_length"] == pytest.approx(1 + s["num_accepted_tokens"] / s["num_drafts"], abs=1e-3)


def test_rejections_across_block_boundaries_free_their_blocks(tiny, poor_draft):
    """Block size 2 and 5 draft tokens: every proposal spans several blocks; after each step a
    speculating request holds exactly the blocks of its accepted tokens."""
    llm = LLM(tiny, max_num_seqs=4, num_kv_blocks=256, block_size=2,
              speculative_config=dict(model=str(poor_draft), num_speculative_tokens=5))
    engine = llm.engine
    for i, prompt in enumerate(tiny_prompts(4, seed=3)):
        engine.add_request(prompt, GREEDY, request_id=str(i))
    rejected_steps = 0
    while engine.has_unfinished_requests():
        before = engine.spec_stats.num_draft_tokens - engine.spec_stats.num_accepted_tokens
        engine.step()
        rejected_steps += engine.spec_stats.num_draft_tokens - engine.spec_stats.num_accepted_tokens > before
        for seq in engine.scheduler.running:
            # the blocks of its computed tokens, at most one more for the token the next step computes:
            # nothing of a rejected run's slots is kept
            needed = engine.kv.blocks_needed
            assert needed(seq.num_computed_tokens) <= len(seq.block_table) <= needed(seq.num_tokens), seq.request_id
            assert seq.num_computed_tokens == seq.num_tokens - 1
        used = sum(b.ref_cnt > 0 for b in engine.kv.blocks)
        assert used == engine.kv.num_used_blocks
    assert rejected_steps > 5
    assert engine.kv.num_used_blocks == 0


def test_stops_inside_an_accepted_run(tiny, tiny_models):
    """With the target as its own draft every proposal is accepted: a stop token, a stop string or
    max_tokens falling inside a run ends the request exactly where plain decoding ends it."""
    prompts = tiny_prompts(4, seed=5)
    base = LLM(tiny, num_kv_blocks=256).generate(prompts, GREEDY)
    spec = dict(model=str(tiny_models["llama"]), num_speculative_tokens=4)
    for i, out in enumerate(base):
        ids, text = out.outputs[0].token_ids, out.outputs[0].text
        variants = [SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
                    SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[ids[6]])]
        if len(text) > 8:
            variants.append(SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[text[4:7]]))
        for params in variants:
            want = LLM(tiny, num_kv_blocks=256).generate([prompts[i]], params)[0].outputs[0]
            outs, engine = spec_run(tiny, spec, [prompts[i]], params, num_kv_blocks=256)
            got = outs[0].outputs[0]
            assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
                   (want.token_ids, want.text, want.finish_reason, want.stop_reason), params
            assert engine.stats().spec_decode["num_accepted_tokens"] > 0


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    from scipy.stats import chisquare

    keep = probs > 0
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    return float(chisquare(counts[keep], expected).pvalue)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> np.ndarray:
    from llmopt.runtime.sampler import filtered_probs

    return filtered_probs(logits, params).double().numpy()


@pytest.mark.parametrize("draft", [0, 3, 7])  # the likeliest token, a middling one, one top_k removes
def test_verification_keeps_the_target_distribution(draft):
    """Rejection sampling with a point proposal: tokens come out with the target's probabilities
    whatever the proposal (chi-square over 20,000 seeded draws), and the naive rule "keep the
    draft if the target might have sampled it" visibly does not."""
    pytest.importorskip("scipy")
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    params = SamplingParams(temperature=0.8, top_k=7, max_tokens=4)
    probs = target_probs(logits, params)
    gen = torch.Generator().manual_seed(1234)
    request = SampleRequest(params, gen, [], [], [])
    counts = np.bincount([verify_row(logits, request, draft).token_id for _ in range(20000)], minlength=8)
    assert chi_square_p(counts, probs) > 1e-3, (counts, probs)
    naive = np.bincount([draft if probs[draft] > 0 else verify_row(logits, request, None).token_id
                         for _ in range(2000)], minlength=8)
    if probs[draft] > 0:
        assert chi_square_p(naive, probs) < 1e-6


def test_sampled_speculation_keeps_the_output_distribution(tiny, tiny_models):
    """End to end on the tiny model: the second output token (the first one a proposal is verified
    for) has the same distribution with speculation as without (two-sample chi-square over 400
    seeded requests each). The target drafts for itself, so its greedy guess is accepted about as
    often as it is rejected at top_k 3."""
    pytest.importorskip("scipy")
    from scipy.stats import chi2_contingency

    prompt = [5, 17, 42]
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=s, ignore_eos=True) for s in range(400)]
    plain = [o.outputs[0].token_ids[1] for o in LLM(tiny, num_kv_blocks=512).generate([prompt] * 400, params)]
    outs, engine = spec_run(tiny, dict(model=str(tiny_models["llama"]), num_speculative_tokens=1), [prompt] * 400,
                            params, num_kv_blocks=512)
    spec = [o.outputs[0].token_ids[1] for o in outs]
    s = engine.stats().spec_decode
    assert s["num_drafts"] == 400 and 50 < s["num_accepted_tokens"] < 350
    tokens = sorted(set(plain) | set(spec))
    table = np.array([[plain.count(t) for t in tokens], [spec.count(t) for t in tokens]])
    table = table[:, table.sum(axis=0) >= 10]  # chi-square needs populated cells
    assert table.shape[1] >= 3
    assert chi2_contingency(table).pvalue > 1e-3


def test_structured_output_holds_under_speculation(tiny, tiny_models):
    pytest.importorskip("llguidance")
    import re

    from llmopt.runtime.closing import CLOSING_WINDOW
    from llmopt.runtime.structured_outputs import StructuredOutputsParams

    so = StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}")
    # a budget beyond the closing window (llmopt.runtime.closing): inside it a constrained row
    # does not speculate, each of its tokens is checked against its closing path instead
    budget = CLOSING_WINDOW + 36
    sampled = [SamplingParams(max_tokens=budget, temperature=1.0, seed=i, structured_outputs=so) for i in range(6)]
    greedy = SamplingParams(max_tokens=budget, temperature=0, structured_outputs=so)
    spec = dict(model=str(tiny_models["llama"]), num_speculative_tokens=4)
    outs, engine = spec_run(tiny, spec, ["the cat"] * 7, sampled + [greedy], num_kv_blocks=256)
    for out in outs:
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out.outputs[0].text), out.outputs[0].text
    plain = LLM(tiny, num_kv_blocks=256).generate(["the cat"], greedy)[0].outputs[0]
    assert outs[-1].outputs[0].token_ids == plain.token_ids
    assert engine.stats().spec_decode["num_accepted_tokens"] > 0
    assert engine.num_constrained == 0


def test_disable_by_batch_size(tiny):
    """More running requests than the limit: no proposals (counted), then speculation resumes as
    the batch shrinks."""
    prompts = tiny_prompts(6, seed=2)
    params = [SamplingParams(max_tokens=4 + 6 * (i == 0), temperature=0, ignore_eos=True) for i in range(6)]
    outs, engine = spec_run(tiny, dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                                       disable_by_batch_size=2), prompts, params, num_kv_blocks=256)
    s = engine.stats().spec_decode
    assert s["num_steps_disabled"] > 0 and s["num_drafts"] > 0
    plain = LLM(tiny, num_kv_blocks=256).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def test_ngram_lookup():
    tokens = np.array([1, 2, 3, 4, 9, 1, 2, 3, 4, 8, 7, 1, 2, 3])
    # the longest suffix (1 2 3) last occurred at 5..7: propose what followed it
    assert find_continuation(tokens, 1, 3, 3) == [4, 8, 7]
    assert find_continuation(tokens, 1, 3, 10) == [4, 8, 7, 1, 2, 3]
    assert find_continuation(np.array([5, 6, 7]), 1, 3, 3) == []
    assert find_continuation(np.array([5, 6, 5]), 2, 3, 3) == []  # only a 1-gram matches
    assert find_continuation(np.array([5, 6, 5]), 1, 3, 3) == [6, 5]


def test_mismatched_draft_is_refused(tiny, tmp_path):
    """A draft whose token ids mean other strings is refused, naming the first differing id."""
    draft = write_tiny_model(tmp_path / "other-vocab", "llama")
    data = json.loads((draft / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (draft / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(LlmoptError, match=r"token id 0 is .* to the target but .* to the draft"):
        LLM(tiny, num_kv_blocks=64, speculative_config=dict(model=str(draft)))
    # the override starts it, and the output is still the target's
    llm = LLM(tiny, num_kv_blocks=64, speculative_config=dict(model=str(draft), allow_mismatch=True))
    assert llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids == \
        LLM(tiny, num_kv_blocks=64).generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids


def test_bad_speculative_configs():
    with pytest.raises(LlmoptError, match="num_speculative_tokens"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=0)
    with pytest.raises(LlmoptError, match="needs a draft model"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(LlmoptError, match="unknown speculative_config key 'num_spec_tokens'"):
        SpeculativeConfig.from_value({"method": "ngram", "num_spec_tokens": 3})
    with pytest.raises(LlmoptError, match="prompt_lookup_min"):
        SpeculativeConfig(method="ngram", prompt_lookup_min=4, prompt_lookup_max=2)


def test_low_acceptance_warns(tiny, poor_draft, caplog):
    spec = dict(model=str(poor_draft), num_speculative_tokens=3, acceptance_window=16)
    with caplog.at_level("WARNING", logger="llmopt.speculative"):
        _, engine = spec_run(tiny, spec, tiny_prompts(4, seed=7), num_kv_blocks=256)
    assert engine.stats().spec_decode["rolling_accepted_per_draft"] < 0.5
    assert any("slowing decoding down" in r.getMessage() for r in caplog.records)
