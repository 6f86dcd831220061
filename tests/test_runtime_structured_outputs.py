"""Structured outputs in the runtime (llguidance): the constraint holds on a random-weight model,
only constrained rows are masked, and bad constraints are refused per request."""

from __future__ import annotations

import re

import pytest

from llmopt.loader import load
from llmopt.errors import LlmoptError
from llmopt.runtime import SamplingParams
from llmopt.runtime.llm import LLM
from llmopt.runtime.structured_outputs import StructuredOutputsParams

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(load(str(tiny_models["llama"]), dtype="float32"), num_kv_blocks=128, max_model_len=128)


def sampled(n: int, so: StructuredOutputsParams, max_tokens: int = 40) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, structured_outputs=so) for i in range(n)]


def test_regex_and_choice_hold_under_sampling(llm):
    outs = llm.generate(["the cat"] * 6, sampled(6, StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}")))
    for out in outs:
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"
    choices = ["red", "green", "blue"]
    outs = llm.generate(["the cat"] * 6, sampled(6, StructuredOutputsParams(choice=choices)))
    assert all(out.outputs[0].text in choices for out in outs)
    assert llm.engine.num_constrained == 0


def test_unconstrained_rows_of_a_batch_are_unaffected(llm):
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = ["the cat sat", "in the beginning", "x y z"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    so = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    mixed = llm.generate(prompts + ["the cat", "the dog"], [plain] * 3 + sampled(2, so, max_tokens=24))
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone


@pytest.mark.parametrize("so, fragment", [
    (dict(json={"type": "nope"}), "invalid JSON schema: Invalid type: nope"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(regex="(unclosed"), "invalid regex"),
    (dict(json={"type": "string", "format": "no-such-format"}), "invalid JSON schema"),
])
def test_bad_constraints_are_refused_per_request(llm, so, fragment):
    outs = llm.generate(["the cat", "the dog"], [SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**so)),
                                                 SamplingParams(max_tokens=4, temperature=0)])
    assert fragment in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) >= 1


def test_params_need_exactly_one_constraint():
    with pytest.raises(LlmoptError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(LlmoptError, match="exactly one"):
        StructuredOutputsParams(regex="a", json_object=True)
    with pytest.raises(LlmoptError, match="choice"):
        StructuredOutputsParams(choice=[])
    # strict=False ignores keywords the back end cannot enforce instead of refusing the schema
    assert StructuredOutputsParams(json={"type": "string", "format": "no-such-format"}, strict=False).lark_or_grammar()
