"""A constrained output never ends broken: near max_tokens the engine closes it along its closing
path (`llmopt.runtime.closing`) and says so (`output_closure`), or says it could not.

The model is the tiny random-weight llama, its logits steered by a bias towards the tokens that
keep a JSON array going (`1`, `,`, ` `), as a small model at temperature 1 loops until max_tokens."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_byte_tokenizer
from llmopt.loader import load
from llmopt.runtime import SamplingParams
from llmopt.runtime.closing import CLOSING_WINDOW, ClosingPaths
from llmopt.runtime.llm import LLM
from llmopt.runtime.structured_outputs import JSON_OPTIONS, StructuredOutputsParams
from llmopt.serve.tools import ChatTool, plan, read

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

# nested arrays and objects, required properties at every level
SCHEMA = {"type": "object", "properties": {
    "grid": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
    "owner": {"type": "object", "properties": {"name": {"type": "string", "minLength": 2},
                                               "tags": {"type": "array", "items": {"enum": ["a", "bb"]}}},
              "required": ["name", "tags"]},
    "ok": {"type": "boolean"}}, "required": ["grid", "owner", "ok"]}
# the shortest valid JSON the walk closes an empty output into
MINIMAL = '{"grid": [], "owner": {"name": "aa", "tags": []}, "ok": true}'
LOOP_BIAS = {"1": 30.0, ",": 29.0, " ": 28.0, "[": 27.0, "{": 26.0}


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(load(str(tiny_models["llama"]), dtype="float32"), num_kv_blocks=256, max_model_len=256)


@pytest.fixture
def looping(llm):
    """The model, steered to loop: the tokens of LOOP_BIAS get their bias added to every logit row."""
    engine, backend = llm.engine, llm.tokenizer.backend
    bias = torch.zeros(engine.vocab_size)
    for t, b in LOOP_BIAS.items():
        bias[backend.encode(t).ids[0]] = b
    execute = engine.runner.execute

    def steered(*args, **kwargs):
        out = execute(*args, **kwargs)
        out.logits = out.logits + bias
        return out

    engine.runner.execute = steered
    yield llm
    engine.runner.execute = execute


def schema_params(max_tokens: int, seed: int, temperature: float = 1.0) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA))


def test_an_output_looping_in_an_array_is_closed_valid_at_max_tokens(looping):
    outs = looping.generate(["the cat"] * 4, [schema_params(120, seed) for seed in range(4)])
    for out in outs:
        c = out.outputs[0]
        assert "1, 1, 1" in c.text  # it looped inside the array...
        assert c.finish_reason == "length" and c.output_closure == "closed", c.text
        assert len(c.token_ids) <= 120
        jsonschema.validate(json.loads(c.text), SCHEMA)  # ...and was closed into valid JSON
    assert looping.engine.num_constrained == 0


def test_the_closing_starts_no_earlier_than_it_must(looping):
    """Closing mode begins when the closing path only just fits: the output uses its whole budget."""
    out = looping.generate("the cat", schema_params(120, 0, temperature=0))[0].outputs[0]
    assert out.output_closure == "closed" and len(out.token_ids) == 120, out.text
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_a_budget_too_small_for_any_valid_completion_says_so(looping):
    outs = looping.generate(["the cat"] * 2, [schema_params(len(MINIMAL) - 10, seed) for seed in range(2)])
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "length" and c.output_closure == "unclosable"
        with pytest.raises(json.JSONDecodeError):
            json.loads(c.text)


def test_outputs_that_end_by_themselves_carry_no_marker(llm):
    # a small enum: the random model ends it long before the window matters
    so = StructuredOutputsParams(json={"enum": ["yes", "no"]})
    out = llm.generate("the cat", SamplingParams(max_tokens=100, temperature=1.0, seed=0, structured_outputs=so))[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].output_closure is None
    plain = llm.generate("the cat", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert plain.outputs[0].finish_reason == "length" and plain.outputs[0].output_closure is None


def test_unconstrained_rows_of_the_batch_are_unaffected(looping):
    plain = SamplingParams(max_tokens=70, temperature=1.0, seed=3, ignore_eos=True)
    alone = looping.generate(["in the beginning"], plain)[0].outputs[0].token_ids
    mixed = looping.generate(["in the beginning", "the cat"], [plain, schema_params(70, 0)])
    assert mixed[0].outputs[0].token_ids == alone and mixed[0].outputs[0].output_closure is None
    assert mixed[1].outputs[0].output_closure == "closed"


# ---- a tool call (hermes format) ---------------------------------------------------------------
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer"}},
                                     "unit": {"enum": ["m", "km"]}},
    "required": ["numbers", "unit"], "additionalProperties": False}}}


def test_a_tool_call_cut_by_max_tokens_is_closed_into_a_valid_call(looping):
    tool_plan = plan([ChatTool.model_validate(ADD)], "required", False, "hermes", None)
    so = StructuredOutputsParams(grammar=tool_plan.grammar())
    outs = looping.generate(["the cat"] * 3, [SamplingParams(max_tokens=150, temperature=1.0, seed=s,
                                                             structured_outputs=so) for s in range(3)])
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "length" and c.output_closure == "closed", c.text
        calls = read(c.text, tool_plan.format, final=True).calls
        assert len(calls) == 1 and calls[0].complete and calls[0].name == "add", c.text
        arguments = json.loads(calls[0].arguments)
        assert len(arguments["numbers"]) > 3  # it looped in the array before it was closed
        jsonschema.validate(arguments, ADD["function"]["parameters"])
        assert c.text.endswith("</tool_call>")


# ---- the walk itself ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def byte_paths():
    backend = make_byte_tokenizer()
    eos = backend.token_to_id("<|endoftext|>")
    ll = llguidance.LLTokenizer(backend.to_str(), n_vocab=backend.get_vocab_size(), eos_token=[eos])
    return backend, ll, ClosingPaths(ll, [eos])


def matcher_after(byte_paths, grammar: str, text: str):
    backend, ll, _ = byte_paths
    matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    for token in backend.encode(text).ids:
        assert matcher.consume_token(token), text
    return matcher


@pytest.mark.parametrize("prefix", ["", '{"grid": [[1, 2], [3', '{"grid": [], "owner": {"na', '{"grid": [[]], "ow',
                                    '{"grid": [], "owner": {"name": "x', '{"grid": [], "owner": {"name": "xy", "tags": ["b'])
def test_the_walk_closes_any_prefix_into_json_that_validates(byte_paths, prefix):
    backend, ll, paths = byte_paths
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides=JSON_OPTIONS)
    matcher = matcher_after(byte_paths, grammar, prefix)
    path = paths.find(matcher)
    assert path is not None
    text = prefix + ll.decode_bytes(path).decode()
    jsonschema.validate(json.loads(text), SCHEMA)
    if not prefix:
        assert text == MINIMAL
    # the matcher is left where it was: the path still takes it to accepting
    assert matcher.validate_tokens(path) == len(path) and not matcher.is_accepting()


def test_the_walk_is_bounded(byte_paths):
    """A grammar the walk's preferences cannot close (it prefers `a` over `c` forever) gives no
    path after MAX_PATH_TOKENS steps, and leaves the matcher as it was."""
    backend, _, paths = byte_paths
    grammar = llguidance.grammar_from("regex", "(ab)*c")
    matcher = matcher_after(byte_paths, grammar, "ab")
    assert paths.find(matcher) is None
    c = backend.encode("c").ids
    assert matcher.validate_tokens(c) == 1 and not matcher.is_accepting() and not matcher.is_error()
