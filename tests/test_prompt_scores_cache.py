"""Prompt logprobs through the prefix cache: a prefix hit answers echo + logprobs with the scores its
blocks keep, equal to a cold request's, without computing the shared context again."""

from __future__ import annotations

import pytest
import torch

from llmopt.loader import load
from llmopt.runtime import SamplingParams
from llmopt.runtime.kv_cache_manager import KVCacheManager
from llmopt.runtime.llm import LLM
from llmopt.runtime.prompt_scores import BlockScores, PromptScores, ScoreBuffer, ScoredChunk
from llmopt.runtime.sequence import Sequence

BLOCK = 16
CONTEXT = [(7 * i + 3) % 250 for i in range(70)]  # 70 tokens: 4 full blocks and 6 more
CHOICES = [[40], [41], [42], [43]]  # lm-eval's MMLU continuations: one token each
PROMPTS = [CONTEXT + c for c in CHOICES]  # 71 tokens: the first 64 can be hits
HITS = 64
# lm-eval's local-completions request: echo + logprobs 1 and one generated token
SCORED = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
# positions computed in chunks of other lengths than the request compared with (the hit request's own
# tail, or a prefix computed in several chunks): the matrix products see other shapes and may round
# differently in the last bits (seen: 5e-7)
TAIL_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return load(str(tiny_models["llama"]), dtype="float32")


def engine(tiny, prefix_caching: bool = True, **kw) -> LLM:
    return LLM(tiny, num_kv_blocks=kw.pop("num_kv_blocks", 64), max_model_len=128, block_size=BLOCK,
               enable_prefix_caching=prefix_caching, **kw)


def count_computed_tokens(llm: LLM) -> list[int]:
    """Tokens each step computed (the runner's scheduled tokens), appended as steps run."""
    counts: list[int] = []
    execute = llm.engine.runner.execute

    def counting(scheduled, *args, **kwargs):
        counts.append(sum(n for _, n in scheduled))
        return execute(scheduled, *args, **kwargs)

    llm.engine.runner.execute = counting
    return counts


def values(entries) -> list[tuple[int, float]]:
    """A position's scores as sorted (token, logprob) pairs: equal means bitwise equal floats."""
    return None if entries is None else sorted(entries.items())


def assert_close(got_scores, want_scores) -> None:
    assert len(got_scores) == len(want_scores)
    for got, want in zip(got_scores, want_scores):
        assert (got is None) == (want is None)
        if want is not None:
            assert got.keys() == want.keys()
            assert [got[t] for t in want] == pytest.approx(list(want.values()), abs=TAIL_TOLERANCE)


def test_choices_sent_at_once_hit_the_context_and_score_it_exactly(tiny):
    """A question's four choices arrive together: the first computes and scores the context, the
    others wait for it and take its blocks as hits; every score equals a cold request's."""
    cold = [engine(tiny, prefix_caching=False).generate([p], SCORED)[0] for p in PROMPTS]
    llm = engine(tiny)
    computed = count_computed_tokens(llm)
    outs = llm.generate(PROMPTS, SCORED)
    assert [o.num_cached_tokens for o in outs] == [0, HITS, HITS, HITS]
    assert sum(computed) == 71 + 3 * (71 - HITS)  # against 4 * 71 without the cache
    assert llm.engine.stats().prefix_cache_hits == 3 * HITS
    for warm, ref in zip(outs, cold):
        assert warm.error is None and warm.outputs[0].token_ids == ref.outputs[0].token_ids
        assert len(warm.prompt_logprobs) == len(ref.prompt_logprobs) == 71
        # the cached positions were computed by the same forward shapes as the cold request's: bitwise
        assert [values(e) for e in warm.prompt_logprobs[:HITS]] == [values(e) for e in ref.prompt_logprobs[:HITS]]
        assert_close(warm.prompt_logprobs[HITS:], ref.prompt_logprobs[HITS:])
    assert llm.engine.num_scoring == 0 and llm.engine.kv.num_used_blocks == 0


@pytest.mark.parametrize("chunk", [16, 23])
def test_hit_after_chunked_scoring_equals_the_first_answer(tiny, chunk):
    """Scores kept across prefill chunks (a block's first position scored in the step before it)."""
    llm = engine(tiny, max_num_batched_tokens=chunk)
    params = SamplingParams(max_tokens=0, prompt_logprobs=2)
    first, again = (llm.generate([CONTEXT], params)[0] for _ in range(2))
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, HITS)
    assert [values(e) for e in again.prompt_logprobs[:HITS]] == [values(e) for e in first.prompt_logprobs[:HITS]]
    assert_close(again.prompt_logprobs[HITS:], first.prompt_logprobs[HITS:])


def test_more_alternatives_than_stored_are_computed(tiny):
    llm = engine(tiny)
    one, three, three_again, two = (llm.generate([CONTEXT], SamplingParams(max_tokens=0, prompt_logprobs=k))[0]
                                    for k in (1, 3, 3, 2))
    assert one.num_cached_tokens == 0
    assert three.num_cached_tokens == 0  # the blocks keep top-1 only: computed again
    assert three_again.num_cached_tokens == HITS  # ... and now keep top-3
    assert two.num_cached_tokens == HITS  # fewer than kept: the first two of them
    for pos in range(1, 70):
        token = CONTEXT[pos]
        top3 = sorted(three.prompt_logprobs[pos].items(), key=lambda kv: -kv[1])
        assert len(three.prompt_logprobs[pos]) in (3, 4) and len(one.prompt_logprobs[pos]) in (1, 2)
        assert three.prompt_logprobs[pos][token] == pytest.approx(one.prompt_logprobs[pos][token], abs=1e-6)
        if pos < HITS:
            assert values(three_again.prompt_logprobs[pos]) == values(three.prompt_logprobs[pos])
            assert two.prompt_logprobs[pos] == dict(top3[:2]) | {token: three.prompt_logprobs[pos][token]}


def test_blocks_of_plain_requests_serve_scores_once_a_scoring_request_computed_them(tiny):
    llm = engine(tiny)
    plain = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1, temperature=0))[0]
    assert plain.num_cached_tokens == 0
    first = llm.generate([PROMPTS[1]], SCORED)[0]
    assert first.num_cached_tokens == 0  # cached K/V without scores: no hit for a scoring request
    second = llm.generate([PROMPTS[2]], SCORED)[0]
    assert second.num_cached_tokens == HITS  # the cached copies took the scores
    assert [values(e) for e in second.prompt_logprobs[:HITS]] == [values(e) for e in first.prompt_logprobs[:HITS]]
    # plain requests still hit whatever holds scores or not
    assert llm.generate([PROMPTS[3]], SamplingParams(max_tokens=1))[0].num_cached_tokens == HITS


def test_a_scoring_request_waits_for_the_request_computing_its_context(tiny):
    llm = engine(tiny, max_num_batched_tokens=50)
    computed = count_computed_tokens(llm)
    eng = llm.engine
    eng.add_request(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=1), request_id="a")
    eng.add_request(PROMPTS[1], SCORED, request_id="b")
    eng.step()  # a: 50 prompt tokens, the whole budget
    eng.step()  # a: its last 21; b had budget left but waits for a's block 3 (positions 48..63)
    assert computed == [50, 21] and [s.request_id for s in eng.scheduler.waiting] == ["b"]
    eng.abort_request("a")  # b goes on without it: a's blocks are registered, with their scores
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert [o.request_id for o in outs] == ["b"] and outs[0].num_cached_tokens == HITS
    assert computed[2:] == [71 - HITS]
    # a computed the context in chunks of 50 and 21 tokens, the cold request in one of 71: near, not bitwise
    cold = engine(tiny, prefix_caching=False).generate([PROMPTS[1]], SCORED)[0]
    assert_close(outs[0].prompt_logprobs, cold.prompt_logprobs)


def test_eviction_drops_the_scores_with_the_block(tiny):
    llm = engine(tiny, num_kv_blocks=6)  # one 71-token request fills 5 blocks
    llm.generate([PROMPTS[0]], SCORED)
    kv = llm.engine.kv
    assert sum(b.scores is not None for b in kv.blocks) == 4
    llm.generate([[200 + i % 50 for i in range(71)]], SamplingParams(max_tokens=1))  # needs 5 blocks: evicts
    assert all(b.scores is None for b in kv.blocks if b.block_hash is None)
    assert sum(b.scores is not None for b in kv.blocks) < 4
    again = llm.generate([PROMPTS[1]], SCORED)[0]
    assert again.num_cached_tokens < HITS and len(again.prompt_logprobs) == 71


# ---- the pieces on their own -------------------------------------------------------------
def scores(n: int, k: int, offset: float = 0.0) -> PromptScores:
    lp = -torch.arange(n, dtype=torch.float32) - offset
    return PromptScores(lp, torch.arange(n * k, dtype=torch.int32).reshape(n, k),
                        -torch.arange(n * k, dtype=torch.float32).reshape(n, k))


def test_to_dicts_puts_the_token_first_then_the_top_n():
    s = PromptScores(torch.tensor([-1.5, -0.25]), torch.tensor([[3, 9], [4, 5]], dtype=torch.int32),
                     torch.tensor([[-0.5, -0.75], [-0.25, -2.0]]))
    assert s.to_dicts([8, 4], 2) == [{8: -1.5, 3: -0.5, 9: -0.75}, {4: -0.25, 5: -2.0}]
    assert s.to_dicts([8, 4], 1) == [{8: -1.5, 3: -0.5}, {4: -0.25}]
    assert s.to_dicts([8, 4], 0) == [{8: -1.5}, {4: -0.25}]


def test_score_buffer_hands_out_whole_blocks_only():
    buf = ScoreBuffer(start=1)
    buf.add(ScoredChunk(1, scores(10, 2), {}))  # positions 1..10
    assert buf.block(0, 4) is None  # no hidden state for its last position yet
    buf.add(ScoredChunk(11, scores(3, 2, 10), {0: torch.ones(8), 1: torch.zeros(8), 2: torch.zeros(8)}))
    block0, block2 = buf.block(0, 4), buf.block(2, 4)
    assert torch.equal(block0.scores.logprobs, -torch.arange(3.0))  # positions 1, 2, 3
    assert block2 is not None and block2.scores.logprobs.tolist() == [-7.0, -8.0, -9.0, -10.0]
    assert buf.block(3, 4) is None  # positions 12..15: 14 and 15 are not scored yet
    buf.drop_before_block(2, 4)
    assert buf.start == 8 and buf.block(0, 4) is None and buf.block(2, 4) is not None
    with pytest.raises(AssertionError):
        buf.add(ScoredChunk(20, scores(1, 2), {}))  # a gap: positions 14..19 missing


def test_kv_manager_clears_scores_on_eviction_and_reset():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    seq = Sequence("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=1), 0.0)
    assert kv.allocate_slots(seq, 5)
    seq.num_computed_tokens = 4
    kv.cache_full_blocks(seq)
    for block_id in seq.block_table[:2]:
        kv.blocks[block_id].scores = BlockScores(scores(2, 1), torch.zeros(4))
    kv.free(seq)
    kv.reset_prefix_cache()
    assert all(b.scores is None and b.block_hash is None for b in kv.blocks)
