"""The answers' bodies as pydantic models, for /openapi.json: a chat.completion and its stream's
chunks, a text_completion, and a Responses API `response` and its stream's events.

The routes write these bodies as dicts (nothing is re-validated per request); the models
document them, field for field, and the tests check real answers against the document.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

# what llmopt did to a constrained output (response_format, structured_outputs, tool calls) that
# max_tokens ended: llmopt.runtime.closing
OutputClosure = Optional[Literal["closed", "unclosable"]]
OUTPUT_CLOSURE_DOC = (
    "llmopt's extension, set when max_tokens ended a constrained output (response_format, "
    "structured_outputs, a tool call): \"closed\" = llmopt closed it along the shortest valid path it "
    "found (arrays and objects closed, required fields filled minimally), so it parses and matches its "
    "schema, but its content was cut short; \"unclosable\" = no valid completion fitted in the budget "
    "left, so the output is cut and does not parse (a cut tool call is left out). null otherwise.")


def closure_field(default: Any = None) -> Any:
    return Field(default=default, description=OUTPUT_CLOSURE_DOC)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


# ---- chat completions ----------------------------------------------------------------------------
class FunctionCallOut(BaseModel):
    name: str
    arguments: str = Field(description="The arguments as a JSON string; they match the function's parameters")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: Optional[str]
    tool_calls: Optional[list[ToolCallOut]] = None


ChatFinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs]
    finish_reason: ChatFinishReason
    output_closure: OutputClosure = closure_field()


class ChatCompletion(BaseModel):
    """A chat completion (`stream` false)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class ToolCallDelta(BaseModel):
    index: int
    id: Optional[str] = Field(default=None, description="On a call's first delta, with its type and name")
    type: Optional[Literal["function"]] = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCallDelta]] = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs]
    finish_reason: Optional[ChatFinishReason]
    output_closure: OutputClosure = closure_field()


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion (`data: {...}`; the last is `data: [DONE]`)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = Field(default=None, description="On the last chunk, with stream_options.include_usage")


# ---- completions -----------------------------------------------------------------------------------
class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: Optional[Literal["stop", "length"]]
    output_closure: OutputClosure = closure_field()
    prompt_logprobs: Optional[list[Optional[dict[str, dict[str, Any]]]]] = Field(
        default=None, description="vLLM's extension: with prompt_logprobs, per prompt position (null first)")


class TextCompletion(BaseModel):
    """A completion (`stream` false); a streamed one sends chunks of the same shape, usage on the last if asked."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


# ---- the Responses API -------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class MessageItem(BaseModel):
    id: str
    type: Literal["message"]
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="The arguments as a JSON string; they match the function's parameters")
    status: ItemStatus


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]
    output_closure: OutputClosure = closure_field()


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class Response(BaseModel):
    """A Responses API `response` (`stream` false; also inside the stream's created and final events)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    model: str
    output: list[Union[MessageItem, FunctionCallItem]]
    error: None
    incomplete_details: Optional[IncompleteDetails]
    instructions: Optional[str]
    max_output_tokens: Optional[int]
    parallel_tool_calls: bool
    previous_response_id: None
    store: Literal[False]
    temperature: float
    top_p: float
    tool_choice: Union[str, dict[str, Any]]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    truncation: Literal["disabled"]
    metadata: dict[str, Any]
    usage: Optional[ResponseUsage]


class ResponseStreamEvent(BaseModel):
    """One server-sent event of a streamed response (`event: TYPE` / `data: {...}`): response.created,
    response.in_progress, response.output_item.added, response.content_part.added,
    response.output_text.delta, response.function_call_arguments.delta, their .done events,
    response.output_item.done, then response.completed or response.incomplete."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int
    response: Optional[Response] = None
    item: Optional[Union[MessageItem, FunctionCallItem]] = None
    output_index: Optional[int] = None
    item_id: Optional[str] = None
    content_index: Optional[int] = None
    delta: Optional[str] = None


def ok_response(model: type[BaseModel], chunk: type[BaseModel], what: str) -> dict[int | str, dict[str, Any]]:
    """A route's documented 200: `model` as JSON, or with `stream: true` server-sent `chunk`s."""
    return {200: {"model": model, "description": f"{what}; with stream: true, server-sent events, each one "
                  f"{chunk.__name__}",
                  "content": {"text/event-stream": {"schema": {"$ref": f"#/components/schemas/{chunk.__name__}"}}}}}


# the stream models /openapi.json refers to without a route returning them as JSON
STREAM_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionChunk, ResponseStreamEvent)
