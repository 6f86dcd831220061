"""Log-likelihood scoring over /v1/completions (echo + logprobs), as evaluation harnesses do it,
against `llmopt eval`'s own log-likelihoods on the default model."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from llmopt.loader import load
from llmopt.eval.metrics.loglikelihood import encode_pair, loglikelihoods
from llmopt.eval.metrics.mmlu import apply_limit, build_requests, load_mmlu, score_mmlu
from llmopt.runtime.async_engine import AsyncLLM
from llmopt.serve.app import ServeConfig, build_app

pytestmark = pytest.mark.integration

CHUNK = 32  # --max-num-batched-tokens: every prompt below spans several prefill chunks
CONTEXT = ("The history of the lighthouse at the harbour mouth goes back three centuries. Built first as a wooden "
           "tower with a coal fire, it was replaced by a stone tower after a storm in the winter of 1791 destroyed "
           "the original. The keepers lived in a small cottage at its foot, and their logbooks, kept without a "
           "break until the light was automated, record the weather, the ships that passed and the repairs made "
           "to the lamp. Today the tower is a museum, and visitors can climb the spiral staircase to the lantern "
           "room, where")
CONTINUATION = " the old lens still turns every night."
# near ties: where eval's two best answers are closer than this, either pick is right
TIE_MARGIN = 1e-3


@pytest.fixture(scope="module")
def loaded():
    return load("default", dtype="float32")


def client_for(loaded, prefix_caching: bool = True, chunk: int = CHUNK) -> TestClient:
    engine = AsyncLLM.from_spec(loaded, max_num_batched_tokens=chunk, enable_prefix_caching=prefix_caching,
                                num_kv_blocks=160, max_model_len=1024)
    return TestClient(build_app(engine, ServeConfig(served_model_name="default")))


@pytest.fixture(scope="module", params=[True, False], ids=["prefix-caching", "no-prefix-caching"])
def http(loaded, request):
    with client_for(loaded, request.param) as client:
        yield client


def encode(loaded, context: str, continuation: str) -> tuple[list[int], list[int]]:
    return encode_pair(lambda text: loaded.tokenizer.encode(text, add_special_tokens=False), context, continuation)


def test_echo_logprobs_equal_eval_loglikelihood(loaded, http):
    ctx, cont = encode(loaded, CONTEXT, CONTINUATION)
    assert len(ctx) > 2 * CHUNK
    expected = loglikelihoods(loaded, [(CONTEXT, CONTINUATION)])[0]
    # a plain request first puts the prompt's blocks into the prefix cache (when it is on)
    assert http.post("/v1/completions", json={"prompt": ctx + cont, "max_tokens": 1}).status_code == 200
    for max_tokens in (0, 1, 0):
        resp = http.post("/v1/completions", json={"prompt": ctx + cont, "echo": True, "logprobs": 1,
                                                  "max_tokens": max_tokens, "temperature": 0})
        assert resp.status_code == 200, resp.text
        lp = resp.json()["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(ctx) + len(cont) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        scored = lp["token_logprobs"][len(ctx) : len(ctx) + len(cont)]
        assert sum(scored) == pytest.approx(expected, abs=1e-4)
        # vLLM's prompt_logprobs extra parameter carries the same numbers
    resp = http.post("/v1/completions", json={"prompt": ctx + cont, "prompt_logprobs": 0, "max_tokens": 1})
    prompt_lps = resp.json()["choices"][0]["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(ctx) + len(cont)
    total = sum(prompt_lps[i][str(t)]["logprob"] for i, t in enumerate(ctx + cont) if i >= len(ctx))
    assert total == pytest.approx(expected, abs=1e-4)


def test_mmlu_through_the_endpoint_picks_eval_answers(loaded):
    """lm-eval's `local-completions` way: token-id prompts context + continuation, four per request,
    echo, logprobs 1, max_tokens 1, the continuation's logprobs summed from token_logprobs[ctxlen:-1]."""
    with client_for(loaded, chunk=1024) as http:
        served_ll, eval_ll, served, reference = _mmlu(loaded, http)
    assert served_ll == pytest.approx(eval_ll, abs=1e-3)
    for q, (mine, theirs) in enumerate(zip(served.predicted, reference.predicted)):
        best = sorted(eval_ll[4 * q : 4 * q + 4], reverse=True)
        assert mine == theirs or best[0] - best[1] < TIE_MARGIN, f"question {q}"


def _mmlu(loaded, http):
    questions = apply_limit(load_mmlu(None), 1)[:24]  # one question from each of 24 subjects
    requests = build_requests(questions)
    pairs = [(r.context, c) for r in requests for c in r.continuations]
    eval_ll = loglikelihoods(loaded, pairs)
    served_ll: list[float] = []
    for r in requests:
        encoded = [encode(loaded, r.context, c) for c in r.continuations]
        resp = http.post("/v1/completions", json={"prompt": [ctx + cont for ctx, cont in encoded], "echo": True,
                                                  "logprobs": 1, "max_tokens": 1, "temperature": 0})
        assert resp.status_code == 200, resp.text
        choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
        for (ctx, _), choice in zip(encoded, choices):
            served_ll.append(sum(choice["logprobs"]["token_logprobs"][len(ctx) : -1]))
    served = score_mmlu(questions, [served_ll[i : i + 4] for i in range(0, len(served_ll), 4)])
    reference = score_mmlu(questions, [eval_ll[i : i + 4] for i in range(0, len(eval_ll), 4)])
    return served_ll, eval_ll, served, reference


def metric(http: TestClient, name: str) -> float:
    line = next(line for line in http.get("/metrics").text.splitlines() if line.startswith(f"llmopt:{name}"))
    return float(line.rsplit(" ", 1)[1])


def test_choices_of_one_question_share_the_context_and_its_scores(loaded):
    """A question's four choices in one request (lm-eval's batches): the first computes and scores
    the context, the others take its blocks as prefix hits and answer from the scores kept with them."""
    prompts = [sum(encode(loaded, CONTEXT, f" {letter}"), []) for letter in "ABCD"]
    assert min(len(p) for p in prompts) > 4 * 16
    body = {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    with client_for(loaded, chunk=1024) as warm, client_for(loaded, prefix_caching=False, chunk=1024) as cold:
        got = sorted(warm.post("/v1/completions", json=body).json()["choices"], key=lambda c: c["index"])
        want = sorted(cold.post("/v1/completions", json=body).json()["choices"], key=lambda c: c["index"])
        hits = [(len(p) - 1) // 16 * 16 for p in prompts]  # all full blocks before the last token
        assert metric(warm, "prefix_cache_hits_total") == sum(hits[1:])
    first = got[0]["logprobs"]
    for i, (mine, theirs) in enumerate(zip(got, want)):
        lp, ref = mine["logprobs"], theirs["logprobs"]
        assert lp["tokens"] == ref["tokens"] and len(lp["token_logprobs"]) == len(prompts[i]) + 1
        # positions served from the cache: bitwise what the first choice (computed cold) answered
        assert lp["token_logprobs"][: hits[i]] == first["token_logprobs"][: hits[i]]
        assert lp["top_logprobs"][: hits[i]] == first["top_logprobs"][: hits[i]]
        # against a server without prefix caching (other batch shapes): equal to rounding
        assert lp["token_logprobs"][1:] == pytest.approx(ref["token_logprobs"][1:], abs=1e-4)
