"""Tool-call formats without a model: each format's grammar accepts the calls it writes and refuses
what breaks them, the reader takes them back out (streamed and whole alike), and the checks of a
request's tools and history name the field at fault."""

from __future__ import annotations

import json

import pytest

from conftest import make_byte_tokenizer
from llmopt.errors import LlmoptError
from llmopt.serve.tools import FORMATS, CallStream, ChatTool, check_history, format_for, plan, read, render_history

llguidance = pytest.importorskip("llguidance")

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"]}}}
TOOLS = [ChatTool.model_validate(WEATHER), ChatTool.model_validate(TIME)]


@pytest.fixture(scope="module")
def tokenizer():
    backend = make_byte_tokenizer()
    ll = llguidance.LLTokenizer(backend.to_str(), n_vocab=backend.get_vocab_size(),
                                eos_token=[backend.token_to_id("<|endoftext|>")])
    return backend, ll


def accepts(tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` whole and may end there."""
    backend, ll = tokenizer
    matcher = llguidance.LLMatcher(ll, llguidance.grammar_from("lark", grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    for token in backend.encode(text).ids:
        if not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


def calls_text(fmt_name: str, *calls: tuple[str, dict]) -> str:
    return FORMATS[fmt_name].calls_text([(name, json.dumps(args)) for name, args in calls])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_forced_grammar_takes_valid_calls_only(tokenizer, fmt):
    required = plan(TOOLS, "required", True, fmt, None)
    grammar = required.grammar()
    one = calls_text(fmt, ("get_weather", {"city": "Paris"}))
    two = calls_text(fmt, ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "utc"}))
    assert accepts(tokenizer, grammar, one)
    assert accepts(tokenizer, grammar, two)
    assert not accepts(tokenizer, grammar, "Sure!")
    assert not accepts(tokenizer, grammar, calls_text(fmt, ("get_weather", {"town": "Paris"})))
    assert not accepts(tokenizer, grammar, calls_text(fmt, ("get_time", {"zone": "mars"})))
    assert not accepts(tokenizer, grammar, calls_text(fmt, ("unknown", {})))
    single = plan(TOOLS, "required", False, fmt, None).grammar()
    assert accepts(tokenizer, single, one) and not accepts(tokenizer, single, two)
    named = plan(TOOLS, _named("get_time"), True, fmt, None).grammar()
    assert accepts(tokenizer, named, calls_text(fmt, ("get_time", {"zone": "local"})))
    assert not accepts(tokenizer, named, one)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_auto_grammar_leaves_text_free_until_the_trigger(tokenizer, fmt):
    grammar = plan(TOOLS, "auto", True, fmt, None).grammar()
    call = calls_text(fmt, ("get_weather", {"city": "Paris"}))
    assert accepts(tokenizer, grammar, "It is sunny in Paris today.")
    assert accepts(tokenizer, grammar, call)
    if not FORMATS[fmt].at_start:
        assert accepts(tokenizer, grammar, "Let me look.\n" + call)
        # once the trigger is written, only a valid call may follow
        assert not accepts(tokenizer, grammar, "Let me look.\n" + FORMATS[fmt].trigger + " oops")
    assert not accepts(tokenizer, grammar, calls_text(fmt, ("get_weather", {"city": 3})))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_streamed_reading_joins_to_the_whole_reading(fmt):
    text = ("Checking.\n" if not FORMATS[fmt].at_start else "") + calls_text(
        fmt, ("get_weather", {"city": "Par\"is {x}"}), ("get_time", {"zone": "utc"}))
    whole = read(text, FORMATS[fmt], final=True)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [
        ("get_weather", {"city": "Par\"is {x}"}), ("get_time", {"zone": "utc"})]
    assert all(c.complete for c in whole.calls)
    stream, content, args, names = CallStream(FORMATS[fmt]), "", {}, {}
    for end in range(1, len(text) + 1):  # one character at a time
        fresh, deltas = stream.update(text[:end], final=end == len(text))
        content += fresh
        for d in deltas:
            if d.opened:
                names[d.index] = d.name
            args[d.index] = args.get(d.index, "") + d.arguments
    assert content == whole.content
    assert [(names[i], args[i]) for i in sorted(args)] == [(c.name, c.arguments) for c in whole.calls]
    assert stream.complete_calls == 2


def test_reader_holds_back_a_partial_trigger_and_drops_nothing_without_calls():
    hermes = FORMATS["hermes"]
    assert read("Hello <tool_", hermes, final=False).content == "Hello "
    assert read("Hello <tool_", hermes, final=True).content == "Hello <tool_"
    cut = read('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', hermes, final=True)
    assert cut.content == "" and not cut.calls[0].complete


def test_format_follows_the_flag_then_the_template():
    assert format_for("mistral", "anything").name == "mistral"
    assert format_for(None, "{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert format_for(None, "<|python_tag|>").name == "llama3_json"
    assert format_for(None, "<|im_start|>").name == "hermes"
    assert format_for(None, None).name == "hermes"


def test_history_for_a_template_without_tools():
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    check_history(messages)
    rendered = render_history(messages, plan(TOOLS, "auto", True, None, None))
    assert rendered[0]["role"] == "system" and "<tools>" in rendered[0]["content"]
    assert "get_time" in rendered[0]["content"]
    assert rendered[2] == {"role": "assistant",
                           "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert rendered[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    # a template that knows tools gets OpenAI's shapes, the arguments as an object
    knows = plan(TOOLS, "auto", True, None, "{% for t in tools %}{% endfor %}")
    assert render_history(messages, knows)[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


@pytest.mark.parametrize("messages, param", [
    ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "call_9", "content": "x"}],
     "messages[1].tool_call_id"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "function": {}}]},
      {"role": "user", "content": "and?"}], "messages[0].tool_calls"),
])
def test_history_errors_name_the_message(messages, param):
    with pytest.raises(LlmoptError) as info:
        check_history(messages)
    assert info.value.param == param


def test_plan_errors_name_the_field():
    bad = ChatTool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}})
    with pytest.raises(LlmoptError, match=r"tools\[0\].function.parameters"):
        plan([bad], "auto", True, None, None)
    strict = ChatTool.model_validate({"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}}})
    with pytest.raises(LlmoptError, match=r"tools\[0\].function.parameters"):
        plan([strict], "auto", True, None, None)
    lenient = strict.model_copy(update={"function": strict.function.model_copy(update={"strict": False})})
    assert plan([lenient], "auto", True, None, None) is not None
    with pytest.raises(LlmoptError, match="not in tools") as info:
        plan(TOOLS, _named("nope"), True, None, None)
    assert info.value.param == "tool_choice"
    assert plan(TOOLS, "none", True, None, None) is None


def _named(name: str):
    from llmopt.serve.tools import NamedToolChoice

    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


def test_auto_needs_the_server_flag():
    from llmopt.serve.protocol import ChatCompletionRequest, RequestError

    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER]})
    with pytest.raises(RequestError, match="--enable-auto-tool-choice") as info:
        body.plan_tools(None, None, auto_allowed=False)
    assert info.value.param == "tool_choice"
    required = body.model_copy(update={"tool_choice": "required"})
    assert required.plan_tools(None, None, auto_allowed=False).forced
    assert "<tool_call>" in required.structured().grammar
