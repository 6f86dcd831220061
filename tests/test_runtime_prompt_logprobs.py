"""Prompt logprobs from the prefill the runtime already runs: equal to a whole-prompt forward,
whatever the chunking, the prefix cache or the other requests in the batch (prefix hits:
tests/test_prompt_scores_cache.py)."""

from __future__ import annotations

import pytest
import torch

from llmopt.loader import load
from llmopt.errors import LlmoptError
from llmopt.eval.metrics.loglikelihood import PackedAttention
from llmopt.runtime import SamplingParams
from llmopt.runtime.llm import LLM

PROMPT = list(range(3, 3 + 70))  # 70 tokens: five 16-token blocks, several prefill chunks below


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return load(str(tiny_models["llama"]), dtype="float32")


def reference(loaded, ids: list[int]) -> torch.Tensor:
    """log_softmax of one whole-prompt forward (no KV cache): [len(ids), vocab]."""
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), PackedAttention([len(ids)]))
        return torch.log_softmax(loaded.model.compute_logits(hidden).float(), dim=-1)


def check_against_reference(ref: torch.Tensor, ids: list[int], scores, top_n: int) -> None:
    assert len(scores) == len(ids) and scores[0] is None
    for pos in range(1, len(ids)):
        entry = scores[pos]
        assert entry[ids[pos]] == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=1e-4)
        top = torch.topk(ref[pos - 1], top_n)
        for tid, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[tid] == pytest.approx(value, abs=1e-4)
        assert len(entry) in (top_n, top_n + 1)  # the prompt token, unless it is among the top N


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("chunk", [16, 23, 1024])
def test_prompt_logprobs_equal_a_whole_prompt_forward(tiny, prefix_caching, chunk):
    llm = LLM(tiny, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=chunk,
              enable_prefix_caching=prefix_caching)
    ref = reference(tiny, PROMPT)
    params = SamplingParams(max_tokens=0, prompt_logprobs=2)
    # twice: the second time the prompt's blocks, with their scores, are in the prefix cache (when it is on)
    for attempt in range(2):
        out = llm.generate([PROMPT], params)[0]
        assert out.error is None and out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
        assert out.num_cached_tokens == (64 if prefix_caching and attempt else 0)
        check_against_reference(ref, PROMPT, out.prompt_logprobs, 2)
    # the blocks it computed serve a later plain request
    plain = llm.generate([PROMPT + [5]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
    assert plain.num_cached_tokens == (64 if prefix_caching else 0)


def test_prompt_logprobs_with_generation_and_a_busy_batch(tiny):
    """Scored prompts next to plain requests mid-decode: the plain requests' greedy tokens are those
    of a run without them, and the scored request generates after its prompt."""
    plain_prompts = ["the cat sat", "in the beginning"]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in
             LLM(tiny, num_kv_blocks=64, max_model_len=128).generate(plain_prompts, greedy)]
    llm = LLM(tiny, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=20)
    scored = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=0, logprobs=1)
    outs = llm.generate(plain_prompts + [PROMPT, PROMPT[:1]], [greedy, greedy, scored, scored])
    assert [o.outputs[0].token_ids for o in outs[:2]] == alone
    assert outs[0].prompt_logprobs is None
    check_against_reference(reference(tiny, PROMPT), PROMPT, outs[2].prompt_logprobs, 0)
    assert len(outs[2].outputs[0].token_ids) == 3
    assert outs[3].prompt_logprobs == [None] and len(outs[3].outputs[0].token_ids) == 3  # one-token prompt
    # the first generated token is the argmax after the whole prompt
    full = reference(tiny, PROMPT + outs[2].outputs[0].token_ids[:1])
    assert outs[2].outputs[0].token_ids[0] == int(full[len(PROMPT) - 1].argmax())
    assert llm.engine.num_scoring == 0 and llm.engine.kv.num_used_blocks == 0


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(LlmoptError, match="positive integer"):
        SamplingParams(max_tokens=0)
    with pytest.raises(LlmoptError, match="prompt_logprobs"):
        SamplingParams(max_tokens=1, prompt_logprobs=21)
    assert SamplingParams(max_tokens=0, prompt_logprobs=0).max_tokens == 0
