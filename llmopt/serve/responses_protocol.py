"""The `/v1/responses` request (OpenAI's Responses API, the stateless part vLLM serves too) and
its translation to the chat completions request that runs it.

The server keeps no state: `store: true` and `previous_response_id` are refused; a client sends
the whole conversation as `input` items each time (messages, its `function_call` items and
their `function_call_output` answers), as the OpenAI Agents SDK does with `store=False`.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmopt.serve.protocol import ChatCompletionRequest, RequestError
from llmopt.serve.tools import FunctionDefinition

# input content parts that carry text; images, files and audio are refused
TEXT_PARTS = {"input_text", "output_text", "text"}


class ResponsesFunctionTool(FunctionDefinition):
    """A Responses API tool: the function's fields at the top level, `{"type": "function", "name": ...}`."""

    type: Literal["function"]


class ResponsesNamedChoice(BaseModel):
    type: Literal["function"]
    name: str


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [
        {"input": "Say this is a test", "max_output_tokens": 16, "temperature": 0},
        {"instructions": "Answer briefly.", "input": [{"role": "user", "content": "Weather in Paris?"}],
         "tools": [{"type": "function", "name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}],
         "tool_choice": "required", "stream": True},
    ]})
    model: str | None = None
    input: Union[str, list[dict[str, Any]]] = Field(description=(
        "A user message, or the conversation as items: messages `{\"role\", \"content\"}` (content a "
        "string or input_text / output_text parts), `{\"type\": \"function_call\", \"call_id\", \"name\", "
        "\"arguments\"}` and `{\"type\": \"function_call_output\", \"call_id\", \"output\"}`"))
    instructions: str | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], ResponsesNamedChoice, None] = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    text: dict[str, Any] | None = Field(default=None, description=(
        "`{\"format\": {\"type\": \"text\" | \"json_object\" | \"json_schema\", \"name\", \"schema\", "
        "\"strict\"}}`"))
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completions request that runs this one; RequestError naming the field at fault."""
        if self.store:
            raise RequestError("store: true is not supported: this server keeps no responses (send the "
                               "conversation as input, with store: false)", param="store")
        if self.previous_response_id is not None:
            raise RequestError("previous_response_id is not supported: this server keeps no responses (send "
                               "the whole conversation as input)", param="previous_response_id")
        body: dict[str, Any] = {"messages": self.messages(), "parallel_tool_calls": self.parallel_tool_calls}
        for name, value in (("model", self.model), ("max_tokens", self.max_output_tokens),
                            ("temperature", self.temperature), ("top_p", self.top_p), ("seed", self.seed)):
            if value is not None:
                body[name] = value
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if isinstance(self.tool_choice, ResponsesNamedChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = (self.text or {}).get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.get("name", "output"), "schema": fmt.get("schema"), "strict": fmt.get("strict", False)}}
        elif isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
            body["response_format"] = {"type": fmt.get("type")}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise RequestError(f"{where}: {first.get('msg', 'invalid value')} (as translated from the "
                               "Responses request)", param=str(first.get("loc", ("input",))[0])) from None

    def messages(self) -> list[dict[str, Any]]:
        """`instructions` and `input` as chat messages: each function_call item joins the assistant
        message before it (as its tool_calls), each function_call_output becomes a tool message."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                messages.append({"role": "system" if role == "developer" else role,
                                 "content": _text(item.get("content"), f"input[{i}].content")})
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and not last.get("closed"):
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                if messages and messages[-1]["role"] == "assistant":
                    messages[-1]["closed"] = True
                messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                                 "content": _text(item.get("output"), f"input[{i}].output")})
            elif kind == "reasoning":
                continue  # another model's reasoning summary: nothing this model can use
            else:
                raise RequestError(f"input[{i}].type {kind!r} is not supported; use message, function_call or "
                                   "function_call_output items", param="input")
        for m in messages:
            m.pop("closed", None)
        return messages


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in TEXT_PARTS:
                raise RequestError(f"{where}: only text content parts are supported, got type {kind!r}",
                                   param="input")
            texts.append(part.get("text", ""))
        return "".join(texts)
    raise RequestError(f"{where} must be a string or a list of text parts", param="input")
