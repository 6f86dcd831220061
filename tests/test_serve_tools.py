"""Tool calling and /v1/responses on `llmopt serve default`, driven by the official openai SDK and
by a real agent framework (the OpenAI Agents SDK), unchanged."""

from __future__ import annotations

import asyncio
import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from test_serve import openai_client, post, served  # noqa: E402

pytestmark = pytest.mark.integration
KEY = "test-key"
# ASCII letters only: at temperature 1 a free string may be written as \u escapes, several tokens a character
WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"}},
                "required": ["city"], "additionalProperties": False}
TIME_ARGS = {"type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
             "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER_ARGS, "get_time": TIME_ARGS}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER_ARGS}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now.",
                                           "parameters": TIME_ARGS}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# the longest call the schemas allow is ~45 tokens: no call below is cut by max_tokens
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def server():
    with served("default", "--api-key", KEY, "--enable-auto-tool-choice", "--max-model-len", "1024") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, KEY)


def check_call(call, names=tuple(SCHEMAS)) -> None:
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_and_required_calls_always_parse(client):
    """20 samples at temperature 1: every one a call whose arguments validate against the schema."""
    named = client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False, n=8, seed=1, temperature=1.0, max_tokens=MAX_TOKENS).choices
    required = [choice for seed, n in ((2, 8), (3, 4)) for choice in client.chat.completions.create(
        model="default", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        n=n, seed=seed, temperature=1.0, max_tokens=MAX_TOKENS).choices]
    for choice in named:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        check_call(choice.message.tool_calls[0], names=("get_time",))
    for choice in required:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        check_call(choice.message.tool_calls[0])
    ids = [c.message.tool_calls[0].id for c in named + required]
    assert len(set(ids)) == 20


def test_streamed_call_deltas_join_to_the_whole_call(client):
    kw = dict(model="default", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=5,
              temperature=1.0, max_tokens=MAX_TOKENS)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:  # the first delta of a call names it, with its id
                    assert d.id.startswith("call_") and d.type == "function" and d.function.name
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments or ""
    assert finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_auto_gives_content_or_a_valid_call(client):
    resp = client.chat.completions.create(model="default", messages=ASK, tools=TOOLS, n=6, seed=3, temperature=1.0,
                                          max_tokens=MAX_TOKENS)
    for choice in resp.choices:
        message = choice.message
        assert "<tool_call>" not in (message.content or "")  # never a half call as text
        if message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in message.tool_calls:
                check_call(call)
        else:
            assert isinstance(message.content, str)


def test_parallel_calls_with_two_tools(client):
    ask = ASK  # at this seed one of the samples calls both functions
    resp = client.chat.completions.create(model="default", messages=ask, tools=TOOLS, tool_choice="required",
                                          n=4, seed=1, temperature=1.0, max_tokens=2 * MAX_TOKENS)
    counts = []
    for choice in resp.choices:
        if choice.finish_reason == "length":
            continue
        calls = choice.message.tool_calls
        for call in calls:
            check_call(call)
        assert len({c.id for c in calls}) == len(calls)
        counts.append(len(calls))
    assert counts and max(counts) >= 2
    single = client.chat.completions.create(model="default", messages=ask, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, n=4, seed=11, temperature=1.0,
                                            max_tokens=MAX_TOKENS)
    assert all(len(c.message.tool_calls) == 1 for c in single.choices)


def test_tool_history_round_trip(client):
    """An assistant call and its tool answer in the history render through the template; the model
    answers in text with tool_choice none."""
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."}]
    resp = client.chat.completions.create(model="default", messages=history, tools=TOOLS, tool_choice="none",
                                          max_tokens=24, temperature=0)
    assert resp.choices[0].message.tool_calls is None and resp.choices[0].message.content


# ---- /v1/responses --------------------------------------------------------------------------
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
                    "parameters": WEATHER_ARGS, "strict": True}]


def test_responses_text_streamed_and_not(client):
    kw = dict(model="default", input="Say hello.", instructions="Be brief.", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kw)
    assert whole.object == "response" and whole.status in ("completed", "incomplete")
    assert whole.output_text and whole.output[0].type == "message"
    assert whole.usage.input_tokens > 0 and 0 < whole.usage.output_tokens <= 12
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == f"response.{'completed' if whole.status == 'completed' else 'incomplete'}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text


def test_responses_function_tool_streamed_and_not(client):
    # one call, then the end of text (with parallel calls a greedy small model repeats its call until the limit)
    kw = dict(model="default", input="What is the weather in Paris?", tools=RESPONSES_TOOLS, tool_choice="required",
              parallel_tool_calls=False, max_output_tokens=MAX_TOKENS, temperature=0)
    whole = client.responses.create(**kw)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert whole.status == "completed" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_ARGS)
    assert calls[0].call_id.startswith("call_") and calls[0].name == "get_weather"
    events = list(client.responses.create(**kw, stream=True))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert added[0].item.type == "function_call" and added[0].item.name == "get_weather"
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == calls[0].arguments
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done[0].arguments == calls[0].arguments
    assert events[-1].type == "response.completed"
    # the next turn: the call and its output as input items, answered in text
    follow = client.responses.create(model="default", max_output_tokens=16, temperature=0, tools=RESPONSES_TOOLS,
                                     tool_choice="none", input=[
                                         {"role": "user", "content": "What is the weather in Paris?"},
                                         {"type": "function_call", "call_id": calls[0].call_id,
                                          "name": "get_weather", "arguments": calls[0].arguments},
                                         {"type": "function_call_output", "call_id": calls[0].call_id,
                                          "output": "Sunny, 21 C."}])
    assert follow.output_text


# ---- a real agent framework -------------------------------------------------------------------
def test_openai_agents_sdk_two_step_loop(server):
    """The OpenAI Agents SDK, unchanged, over /v1/responses: the model calls get_weather(city), the
    test's tool answers, the model's final message comes back."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"It is sunny and 21 C in {city}."

    model = agents.OpenAIResponsesModel(model="default",
                                        openai_client=openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY))
    # the first turn must call (a 135M model rarely decides to); the SDK resets tool_choice after a
    # call. The SDK fails a response cut by max_output_tokens: room for the final answer.
    agent = agents.Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                         model=model, model_settings=agents.ModelSettings(
                             tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=256))
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert len(cities) >= 1 and all(isinstance(c, str) for c in cities)
    assert isinstance(result.final_output, str) and result.final_output


# ---- bad input ---------------------------------------------------------------------------------
def refusal(server, path: str, body: dict) -> dict:
    resp = post(server, path, body)
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


def test_invalid_parameter_schema_is_refused(server):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                          "properties": {"a": {"type": "strin"}}}}}]
    error = refusal(server, "/v1/chat/completions", {"messages": ASK, "tools": bad})
    assert error["param"] == "tools" and "tools[0].function.parameters" in error["message"]


def test_tool_choice_naming_an_unknown_function_is_refused(server):
    error = refusal(server, "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_stock_price"}}})
    assert error["param"] == "tool_choice" and "get_stock_price" in error["message"]


def test_tool_message_without_tool_call_id_is_refused(server):
    messages = [*ASK, {"role": "tool", "content": "Sunny."}]
    error = refusal(server, "/v1/chat/completions", {"messages": messages, "tools": TOOLS})
    assert error["param"] == "messages[1].tool_call_id"


def test_unanswered_tool_call_id_is_refused(server):
    messages = [*ASK, {"role": "assistant", "tool_calls": [{"id": "call_7", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]}, {"role": "user", "content": "Well?"}]
    error = refusal(server, "/v1/chat/completions", {"messages": messages, "tools": TOOLS})
    assert error["param"] == "messages[1].tool_calls" and "call_7" in error["message"]


@pytest.mark.parametrize("field, value", [("store", True), ("previous_response_id", "resp_1")])
def test_responses_state_is_refused(server, field, value):
    error = refusal(server, "/v1/responses", {"input": "Hi", field: value})
    assert error["param"] == field and "keeps no" in error["message"]


# ---- a constrained output never ends broken -----------------------------------------------------
# a list the small model keeps writing: at temperature 1 it loops in the array until max_tokens
LIST_SCHEMA = {"type": "object", "properties": {
    "fruits": {"type": "array", "items": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"}},
    "count": {"type": "integer"}}, "required": ["fruits", "count"], "additionalProperties": False}
LIST_FORMAT = {"type": "json_schema", "json_schema": {"name": "fruits", "schema": LIST_SCHEMA}}
LIST_ASK = [{"role": "user", "content": "List twenty fruits as JSON."}]
ADD_ARGS = {"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer"}}},
            "required": ["numbers"], "additionalProperties": False}
ADD_TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add up numbers.",
                                               "parameters": ADD_ARGS}}]


def answer(server, path: str, body: dict) -> dict:
    import httpx

    resp = httpx.post(server + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=600)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_json_outputs_cut_by_max_tokens_are_closed_or_say_so(server):
    """Several seeds at temperature 1 with a small max_tokens: every answer the budget ended either
    parses and validates (output_closure "closed") or says it could not be closed; none is
    silently broken."""
    choices = [c for seed in (1, 2) for c in answer(server, "/v1/chat/completions", {
        "messages": LIST_ASK, "response_format": LIST_FORMAT, "temperature": 1.0, "seed": seed, "n": 4,
        "max_tokens": 32})["choices"]]
    closures = []
    for c in choices:
        text, closure = c["message"]["content"], c["output_closure"]
        # (null with "length": the model itself completed the JSON with the budget's last token)
        assert c["finish_reason"] == "length" or (c["finish_reason"] == "stop" and closure is None)
        if closure == "unclosable":
            with pytest.raises(json.JSONDecodeError):
                json.loads(text)
        else:
            jsonschema.validate(json.loads(text), LIST_SCHEMA)
        closures.append(closure)
    assert "closed" in closures  # the budget did end some answers inside the JSON
    # too small a budget for any valid answer: said so
    tiny = answer(server, "/v1/chat/completions", {"messages": LIST_ASK, "response_format": LIST_FORMAT,
                                                   "max_tokens": 3, "temperature": 1.0, "seed": 1})["choices"][0]
    assert tiny["finish_reason"] == "length" and tiny["output_closure"] == "unclosable"


def test_a_streamed_closed_output_says_so_on_its_last_chunk(client):
    # 16 tokens: room for the smallest answer (~10 tokens), not for twenty fruits; greedy, so the
    # answer moves only at a near tie on another machine, not with every rounding of a sampled draw
    kw = dict(model="default", messages=LIST_ASK, response_format=LIST_FORMAT, temperature=0, max_tokens=16)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = [choice for chunk in client.chat.completions.create(**kw, stream=True) for choice in chunk.choices]
    assert "".join(c.delta.content or "" for c in chunks) == whole.message.content
    assert chunks[-1].finish_reason == whole.finish_reason == "length"
    assert getattr(chunks[-1], "output_closure", None) == getattr(whole, "output_closure", None) == "closed"
    jsonschema.validate(json.loads(whole.message.content), LIST_SCHEMA)


def test_a_tool_call_cut_by_max_tokens_is_closed_or_left_out(server):
    body = {"messages": [{"role": "user", "content": "Add up the numbers from 1 to 50."}], "tools": ADD_TOOLS,
            "tool_choice": "required", "parallel_tool_calls": False, "temperature": 1.0, "seed": 4, "n": 4}
    for c in answer(server, "/v1/chat/completions", {**body, "max_tokens": 40})["choices"]:
        assert c["finish_reason"] in ("length", "tool_calls") and c["output_closure"] in ("closed", None)
        (call,) = c["message"]["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), ADD_ARGS)
    # no call fits in 12 tokens (`<tool_call>\n{"name": "add", "arguments": {"numbers": []}}\n</tool_call>`)
    cut = answer(server, "/v1/chat/completions", {**body, "n": 1, "max_tokens": 12})["choices"][0]
    assert cut["finish_reason"] == "length" and cut["output_closure"] == "unclosable"
    assert cut["message"].get("tool_calls") is None  # never a half call
    response = answer(server, "/v1/responses", {
        "input": "Add up the numbers from 1 to 50.", "tools": [{"type": "function", **ADD_TOOLS[0]["function"]}],
        "tool_choice": "required", "max_output_tokens": 12, "temperature": 1.0, "seed": 4})
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens", "output_closure": "unclosable"}
    assert not [item for item in response["output"] if item["type"] == "function_call"]


# ---- /openapi.json types the answers ------------------------------------------------------------
def test_answers_match_the_bodies_openapi_documents(server):
    import httpx

    doc = httpx.get(server + "/openapi.json", timeout=30).json()
    paths = doc["paths"]

    def check(instance: dict, path: str, media: str = "application/json") -> None:
        ref = paths[path]["post"]["responses"]["200"]["content"][media]["schema"]["$ref"]
        jsonschema.validate(instance, {"$ref": ref, "components": doc["components"]})

    chat = answer(server, "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                                   "parallel_tool_calls": False, "max_tokens": MAX_TOKENS,
                                                   "temperature": 0, "logprobs": True, "top_logprobs": 1})
    assert chat["choices"][0]["message"]["tool_calls"]
    check(chat, "/v1/chat/completions")
    closed = answer(server, "/v1/chat/completions", {"messages": LIST_ASK, "response_format": LIST_FORMAT,
                                                     "max_tokens": 16, "temperature": 0})
    check(closed, "/v1/chat/completions")
    assert closed["choices"][0]["output_closure"] == "closed"
    with pytest.raises(jsonschema.ValidationError):  # the check can fail
        check({**closed, "choices": [{**closed["choices"][0], "output_closure": "half"}]}, "/v1/chat/completions")
    check(answer(server, "/v1/completions", {"prompt": "The sky is", "max_tokens": 4, "temperature": 0,
                                             "logprobs": 1}), "/v1/completions")
    response = answer(server, "/v1/responses", {"input": "What is the weather in Paris?", "tools": RESPONSES_TOOLS,
                                                "tool_choice": "required", "parallel_tool_calls": False,
                                                "max_output_tokens": MAX_TOKENS, "temperature": 0})
    check(response, "/v1/responses")
    assert [item["type"] for item in response["output"]] == ["function_call"]
    for path in ("/v1/chat/completions", "/v1/responses"):
        ref = paths[path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]["$ref"]
        assert ref.rsplit("/", 1)[1] in doc["components"]["schemas"]
    assert "output_closure" in doc["components"]["schemas"]["ChatChunkChoice"]["properties"]
