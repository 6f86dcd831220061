"""Tool calling: the request's tools, the call formats (vLLM's `--tool-call-parser` names), the
llguidance grammar that holds a call to its function's `parameters` schema, the prompt for chat
templates that know no tools, and the reader that takes the calls back out of the text.

Every call llmopt returns parses and matches its schema because the model could write nothing
else: with `tool_choice` `required` or a named function the whole output is held to the call
format; with `auto` the text is free until the format's trigger (`<tool_call>` for hermes), and
from there on the grammar holds it (a lazy lexeme in llguidance's Lark syntax, as llama.cpp's
lazy grammars do). Each format writes a call as `{"name": "NAME", "arguments": {...}}` with the
name first, so a stream can name a call before its arguments are complete.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, field_validator

from llmopt.errors import LlmoptError
from llmopt.runtime.structured_outputs import JSON_OPTIONS

# OpenAI's rule for function names; it also keeps names safe inside the grammar and the reader
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not NAME_PATTERN.match(value):
            raise ValueError(f"function name {value!r} must be 1-64 letters, digits, '_' or '-'")
        return value


class ChatTool(BaseModel):
    """A chat completions tool: `{"type": "function", "function": {...}}`."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the one function the model must call."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str  # the arguments as a JSON string, as OpenAI gives them


class ToolCall(BaseModel):
    """An assistant message's call in the conversation history."""

    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


@dataclass(frozen=True)
class ToolFormat:
    """How one model family writes calls: `before` the first, `between` two, `after` the last;
    in each the JSON object `{"name": ..., "<args_key>": {...}}`. `trigger` is where calls start in
    a free (`auto`) answer; `at_start` formats (llama3_json) allow calls only as the whole answer."""

    name: str
    before: str
    between: str
    after: str
    trigger: str
    args_key: str = "arguments"
    at_start: bool = False

    def call_text(self, name: str, arguments: str) -> str:
        return f'{{"name": "{name}", "{self.args_key}": {arguments}}}'

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        """Calls as the model writes them (history rendered for templates without tools)."""
        return self.before + self.between.join(self.call_text(n, a) for n, a in calls) + self.after


# vLLM's parser names; hermes is also Qwen2.5's format
FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>", "<tool_call>"),
    "llama3_json": ToolFormat("llama3_json", "", "; ", "", "{", args_key="parameters", at_start=True),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS][", ", ", "]", "[TOOL_CALLS]"),
}
DEFAULT_FORMAT = "hermes"


def format_for(parser: str | None, chat_template: str | None) -> ToolFormat:
    """`--tool-call-parser`, else what the chat template writes, else hermes (the documented default
    for templates that know no tools, such as the embedded SmolLM2's)."""
    if parser is not None:
        return FORMATS[parser]
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<|python_tag|>" in template or "<|eom_id|>" in template:
        return FORMATS["llama3_json"]
    return FORMATS[DEFAULT_FORMAT]


@dataclass
class ToolPlan:
    """What a request with tools asks for, checked: its functions, which must be called, how many."""

    tools: list[ChatTool]
    choice: Literal["auto", "required"] | str  # a function's name for a named choice
    parallel: bool
    format: ToolFormat
    template_knows_tools: bool

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    # ---- the grammar ----------------------------------------------------------------------
    def grammar(self) -> str:
        """The llguidance Lark grammar holding the output to this plan's calls."""
        fmt = self.format
        tools = [t for t in self.tools if self.choice in ("auto", "required") or t.function.name == self.choice]
        rules = []
        for i, tool in enumerate(tools):
            f = tool.function
            head = json.dumps(f'{{"name": "{f.name}", "{fmt.args_key}": ')
            rules.append(f"call{i}: {head} args{i} \"}}\"")
            rules.append(f"args{i}: %json {json.dumps(function_schema(f))}")
        calls = "call" if not self.parallel else f"call ({json.dumps(fmt.between)} call)*"
        lines = [f"call: {' | '.join(f'call{i}' for i in range(len(tools)))}", *rules]
        if self.forced:
            lines.insert(0, f"start: {json.dumps(fmt.before)} {calls} {json.dumps(fmt.after)}")
        elif fmt.at_start:
            # free text that does not start like a call, or calls only
            lines[:0] = [f"start: TEXT | {json.dumps(fmt.before)} {calls} {json.dumps(fmt.after)}",
                         f"TEXT: /[^{re.escape(fmt.trigger[0])}](?s:.*)/ | \"\""]
        else:
            # lazy: `head` ends at the first trigger, after which only calls may follow
            rest = fmt.before[len(fmt.trigger):]
            lines[:0] = [f"start: TEXT | head {json.dumps(rest)} {calls} {json.dumps(fmt.after)}",
                         "TEXT: /(?s:.*)/", f"head[lazy]: /(?s:.*){re.escape(fmt.trigger)}/"]
        return "\n".join(lines)

    # ---- the prompt -----------------------------------------------------------------------
    def instructions(self) -> str:
        """The system prompt describing the functions, for templates that know no tools (hermes'
        wording, as Qwen2.5's template writes it; the call example in this plan's format)."""
        fmt = self.format
        listed = "\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in self.tools)
        example = fmt.before + fmt.call_text("<function-name>", "<args-json-object>") + fmt.after
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                f"<tools>\n{listed}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments in this format:\n"
                f"{example}")


def function_schema(f: FunctionDefinition) -> dict[str, Any]:
    """The function's parameters schema with llmopt's JSON layout; strict functions refuse keywords
    llguidance cannot enforce (as response_format's strict does), others ignore them."""
    schema = dict(f.parameters) if f.parameters else {"type": "object", "properties": {}}
    schema.setdefault("type", "object")
    schema["x-guidance"] = dict(JSON_OPTIONS, lenient=not f.strict)
    return schema


def check_schema(f: FunctionDefinition) -> str | None:
    """What is wrong with a function's parameters schema for llguidance, or None."""
    from llguidance import LLMatcher

    if f.parameters is not None and f.parameters.get("type", "object") != "object":
        return "must be a JSON schema of type object"
    try:
        grammar = LLMatcher.grammar_from_json_schema(function_schema(f))
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, None)
    except Exception as exc:  # llguidance's own refusal of a schema it cannot read: bad input, not a 500
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if is_error:
        return messages[0].splitlines()[0] if messages else "rejected by llguidance"
    return None


def plan(tools: list[ChatTool] | None, tool_choice: ToolChoice | None, parallel: bool,
         parser: str | None, chat_template: str | None) -> ToolPlan | None:
    """The checked plan of a request's tools, or None when it asks for no call (no tools, or
    `tool_choice: "none"`); LlmoptError naming the field at fault."""
    if tool_choice is not None and not tools and tool_choice != "none":
        raise LlmoptError("tool_choice needs tools", param="tool_choice")
    if not tools:
        return None
    names = [t.function.name for t in tools]
    for i, tool in enumerate(tools):
        if names.index(tool.function.name) != i:
            raise LlmoptError(f"tools[{i}].function.name: {tool.function.name!r} is defined twice", param="tools")
        problem = check_schema(tool.function)
        if problem is not None:
            raise LlmoptError(f"tools[{i}].function.parameters: invalid schema: {problem}", param="tools")
    choice: str = "auto" if tool_choice is None else (
        tool_choice if isinstance(tool_choice, str) else tool_choice.function.name)
    if choice == "none":
        return None
    if choice not in ("auto", "required") and choice not in names:
        raise LlmoptError(f"tool_choice names the function {choice!r}, which is not in tools "
                          f"({', '.join(names)})", param="tool_choice")
    return ToolPlan(tools, choice, parallel, format_for(parser, chat_template), template_knows_tools(chat_template))


def template_knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def check_history(messages: list[dict[str, Any]]) -> None:
    """Every `role: "tool"` message answers a call of the assistant message before it, and every
    such call is answered (OpenAI's rules); LlmoptError naming the message otherwise."""
    waiting: dict[str, int] = {}  # call id -> index of the assistant message that made it
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            call_id = m.get("tool_call_id")
            if not call_id:
                raise LlmoptError(f"messages[{i}].tool_call_id: a tool message needs the id of the call it "
                                  "answers", param=f"messages[{i}].tool_call_id")
            if waiting.pop(call_id, None) is None:
                raise LlmoptError(f"messages[{i}].tool_call_id: {call_id!r} answers no call of the assistant "
                                  "message before it", param=f"messages[{i}].tool_call_id")
            continue
        if waiting:
            first = min(waiting.values())
            raise LlmoptError(f"messages[{first}].tool_calls: no tool message answers "
                              f"{', '.join(sorted(waiting))}", param=f"messages[{first}].tool_calls")
        waiting = {c["id"]: i for c in m.get("tool_calls") or []}
    if waiting:
        first = min(waiting.values())
        raise LlmoptError(f"messages[{first}].tool_calls: no tool message answers {', '.join(sorted(waiting))}",
                          param=f"messages[{first}].tool_calls")


# ---- reading calls out of the text -----------------------------------------------------------
_HEAD = re.compile(r'\{"name": "([A-Za-z0-9_-]+)", "(?:arguments|parameters)": ')


@dataclass
class PartialCall:
    name: str
    arguments: str  # as far as written
    complete: bool


@dataclass
class Snapshot:
    """The text read so far: the content before any call, and the calls begun."""

    content: str
    calls: list[PartialCall] = field(default_factory=list)


def read(text: str, fmt: ToolFormat, final: bool) -> Snapshot:
    """The content and calls in `text`. Mid-stream (`final` False) a tail that may be the start of
    the trigger is held back from the content."""
    start = text.find(fmt.trigger) if not fmt.at_start else (0 if text.startswith(fmt.trigger) else -1)
    if start < 0:
        if final:
            return Snapshot(text)
        keep = len(text)
        for n in range(min(len(fmt.trigger) - 1, len(text)), 0, -1):
            if fmt.trigger.startswith(text[-n:]) and (not fmt.at_start or n == len(text)):
                keep = len(text) - n
                break
        return Snapshot(text[:keep])
    snap, pos = Snapshot(text[:start]), start
    while (m := _HEAD.search(text, pos)) is not None:
        end = json_end(text, m.end())
        snap.calls.append(PartialCall(m.group(1), text[m.end(): end or len(text)], end is not None))
        if end is None:
            break
        pos = end
    return snap


def json_end(text: str, i: int) -> int | None:
    """The index after the JSON object or array starting at `text[i]`, None if it is not closed yet."""
    depth, in_string, escaped = 0, False, False
    for j in range(i, len(text)):
        ch = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


# ---- the conversation -------------------------------------------------------------------------
def render_history(messages: list[dict[str, Any]], plan: ToolPlan | None, fmt: ToolFormat | None = None,
                   knows_tools: bool = False) -> list[dict[str, Any]]:
    """Messages for the chat template. A template that knows tools gets OpenAI's shapes (call
    arguments as objects, as Hugging Face templates expect); one that does not gets the calls as
    text in the plan's format, each tool answer as a user turn in `<tool_response>` tags (as
    Qwen2.5's template writes them) and the functions described in the system prompt. Without a
    plan (no tools, or tool_choice none) `fmt` and `knows_tools` say how to write the history."""
    if plan is not None:
        fmt, knows_tools = plan.format, plan.template_knows_tools
    fmt = fmt or FORMATS[DEFAULT_FORMAT]
    out: list[dict[str, Any]] = []
    for m in messages:
        calls = m.get("tool_calls") or []
        if knows_tools:
            if calls:
                m = {**m, "tool_calls": [{**c, "function": {"name": c["function"]["name"],
                                                            "arguments": _as_object(c["function"]["arguments"])}}
                                         for c in calls]}
            out.append(m)
        elif m["role"] == "tool":
            answer = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("from_tool"):  # consecutive answers share one turn
                out[-1]["content"] += "\n" + answer
            else:
                out.append({"role": "user", "content": answer, "from_tool": True})
        elif calls:
            text = fmt.calls_text([(c["function"]["name"], c["function"]["arguments"]) for c in calls])
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + text})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    for m in out:
        m.pop("from_tool", None)
    if plan is not None and not knows_tools:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + plan.instructions()}
        else:
            out.insert(0, {"role": "system", "content": plan.instructions()})
    return out


def _as_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments



@dataclass
class CallDelta:
    """A streamed call's news: `opened` on its first delta (with its id and name), then more arguments."""

    index: int
    id: str
    name: str
    arguments: str
    opened: bool


@dataclass
class CallStream:
    """One streamed choice: what of its content and calls has been sent, and what is new."""

    format: ToolFormat
    content_sent: int = 0
    ids: list[str] = field(default_factory=list)
    args_sent: list[int] = field(default_factory=list)
    complete_calls: int = 0

    def update(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        """The new content and call deltas in `text` (everything generated so far). Once the output
        ends, an unfinished call (cut by max_tokens) sends nothing more."""
        snap = read(text, self.format, final)
        self.complete_calls = sum(c.complete for c in snap.calls)
        content = snap.content[self.content_sent:]
        self.content_sent = max(self.content_sent, len(snap.content))
        deltas = []
        for i, call in enumerate(snap.calls):
            opened = i == len(self.ids)
            if opened:
                self.ids.append(new_call_id())
                self.args_sent.append(0)
            fresh = call.arguments[self.args_sent[i]:]
            self.args_sent[i] = len(call.arguments)
            if opened or fresh:
                deltas.append(CallDelta(i, self.ids[i], call.name, fresh, opened))
        return content, deltas
