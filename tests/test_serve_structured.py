"""Structured output through the endpoint on the default model: response_format json_schema and
json_object, chat and completions, streaming and not; unconstrained requests beside them unchanged."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from llmopt.loader import load
from llmopt.runtime import SamplingParams
from llmopt.runtime.async_engine import AsyncLLM
from llmopt.runtime.llm import LLM
from llmopt.runtime.structured_outputs import StructuredOutputsParams
from llmopt.serve.app import ServeConfig, build_app

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytestmark = pytest.mark.integration

PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "species": {"enum": ["cat", "dog", "rabbit"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                                   "city": {"type": "string", "maxLength": 40}},
                  "required": ["name", "city"], "additionalProperties": False},
        "toys": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "species", "age", "owner", "toys"],
    "additionalProperties": False,
}
ASK = "Describe a pet as JSON with name, species, age, owner (name, city) and toys."
MESSAGES = [{"role": "user", "content": ASK}]
# the longest output PET allows is ~230 tokens: enough that no sample is cut by max_tokens
MAX_TOKENS = 300
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
TIE_MARGIN = 1e-3  # reference top-2 log-probability gap below which two numeric paths may part


@pytest.fixture(scope="module")
def loaded():
    return load("default", dtype="float32")


@pytest.fixture(scope="module")
def http(loaded):
    from starlette.testclient import TestClient

    engine = AsyncLLM.from_spec(loaded, num_kv_blocks=512, max_model_len=1024)
    with TestClient(build_app(engine, ServeConfig(served_model_name="default"))) as client:
        yield client


def sse_texts(body: str) -> dict[int, str]:
    texts: dict[int, str] = {}
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + (
                    choice["delta"].get("content") or "" if "delta" in choice else choice["text"])
    return texts


def test_twenty_sampled_completions_follow_the_schema(http):
    """Four requests at once (so their samples share batches): chat and completions, streamed and not."""
    chat = {"messages": MESSAGES, "response_format": RESPONSE_FORMAT, "temperature": 1.0, "max_tokens": MAX_TOKENS}
    completion = {"prompt": f"{ASK}\nJSON:", "response_format": RESPONSE_FORMAT, "temperature": 1.0,
                  "max_tokens": MAX_TOKENS}
    calls = [("/v1/chat/completions", {**chat, "n": 8, "seed": 1}),
             ("/v1/chat/completions", {**chat, "n": 6, "seed": 100, "stream": True}),
             ("/v1/completions", {**completion, "n": 3, "seed": 200}),
             ("/v1/completions", {**completion, "n": 3, "seed": 300, "stream": True})]
    with ThreadPoolExecutor(len(calls)) as pool:
        responses = list(pool.map(lambda call: http.post(call[0], json=call[1]), calls))
    texts: list[str] = []
    for (_, body), resp in zip(calls, responses):
        assert resp.status_code == 200, resp.text
        if body.get("stream"):
            texts += list(sse_texts(resp.text).values())
        else:
            texts += [c["message"]["content"] if "message" in c else c["text"] for c in resp.json()["choices"]]
    assert len(texts) == 20
    for text in texts:
        jsonschema.validate(json.loads(text), PET)


def test_json_object_mode_parses(http):
    resp = http.post("/v1/chat/completions", json={"messages": MESSAGES, "response_format": {"type": "json_object"},
                                                   "temperature": 1.0, "n": 3, "seed": 7, "max_tokens": MAX_TOKENS})
    for choice in resp.json()["choices"]:
        if choice["finish_reason"] == "stop":  # an object with free-form strings may run past max_tokens
            assert isinstance(json.loads(choice["message"]["content"]), dict)
        else:
            assert choice["message"]["content"].startswith("{")
    greedy = http.post("/v1/chat/completions", json={"messages": MESSAGES, "response_format": {"type": "json_object"},
                                                     "temperature": 0, "max_tokens": MAX_TOKENS}).json()
    assert greedy["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(greedy["choices"][0]["message"]["content"]), dict)


def test_unconstrained_requests_in_the_same_batch_are_unaffected(loaded):
    """Greedy plain requests batched with constrained ones pick the tokens of a run without them
    (compared up to the reference's first near tie: a different batch is a different numeric path)."""
    llm = LLM(loaded, num_kv_blocks=512, max_model_len=1024)
    prompts = [[{"role": "user", "content": q}] for q in ("What is the capital of France?", "Name three colours.")]
    plain = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, logprobs=2)
    alone = [o.outputs[0] for o in llm.chat(prompts, plain)]
    constrained = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i,
                                  structured_outputs=StructuredOutputsParams(json=PET)) for i in range(3)]
    mixed = llm.chat(prompts + [MESSAGES] * 3, [plain, plain] + constrained)
    for ref, out in zip(alone, mixed[:2]):
        tokens = out.outputs[0].token_ids
        for pos, (token, lp) in enumerate(zip(ref.token_ids, ref.logprobs)):
            top = sorted(lp.values(), reverse=True)
            if len(top) > 1 and top[0] - top[1] < TIE_MARGIN:
                break
            assert tokens[pos] == token, f"position {pos}"
    for out in mixed[2:]:
        jsonschema.validate(json.loads(out.outputs[0].text), PET)
