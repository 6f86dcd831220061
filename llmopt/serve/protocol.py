"""OpenAI request schemas: what we read from a request, validated.

Unknown fields are accepted (clients send many) and reported by `ignored_fields` so the app
can log each name once; a known OpenAI field llmopt cannot honour (`logit_bias`, `suffix`,
the legacy `functions`, `tools` on completions, ...) is refused by `check_supported` rather than
dropped.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictFloat, StrictInt, field_validator

from llmopt.errors import LlmoptError
from llmopt.runtime import SamplingParams
from llmopt.runtime.engine_protocol import ServingEngine
from llmopt.runtime.structured_outputs import StructuredOutputsParams
from llmopt.serve import tools as tool_calls
from llmopt.serve.tools import ChatTool, ToolCall, ToolChoice, ToolPlan

MAX_N = 8
# OpenAI's own limit on a chat request's messages
MAX_MESSAGES = 2048
Role = Literal["system", "user", "assistant", "tool", "developer"]
ROLES = set(get_args(Role))


# Known OpenAI / vLLM request fields llmopt cannot honour, refused when set to anything but
# these harmless values (a client that sends `"tools": []` or `"logit_bias": null` asked for nothing)
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "functions": (None, []), "function_call": (None, "none", "auto"),
    "tool_choice": (None, "none", "auto"), "logit_bias": (None, {}), "suffix": (None, ""), "best_of": (None, 1),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,), "web_search_options": (None,),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
}
WHAT_INSTEAD = {name: "use response_format or structured_outputs" for name in UNSUPPORTED_FIELDS
                if name.startswith("guided_")}


_JSON_TYPES = {dict: "JSON object", str: "string", bool: "boolean", list: "list"}


class SamplingRequest(BaseModel):
    """What chat and completions requests share: the model, sampling and output-format fields."""

    # OpenAI clients send fields we do not use (user, metadata, ...): accept them (`ignored_fields`
    # names them for a warning); the known ones we cannot honour are refused (`check_supported`).
    # Values as OpenAI's schema types them (pydantic's strict types): integers are JSON integers
    # (not `true`, "5" or 5.0), numbers are numbers (not `true` or "1"), booleans are booleans;
    # and numbers are finite (Python's JSON reader takes NaN, Infinity and 1e999).
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    refused: ClassVar[tuple[str, ...]] = tuple(UNSUPPORTED_FIELDS)

    model: str | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat = Field(default=1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=0, ge=-1)
    min_p: StrictFloat = Field(default=0.0, ge=0.0, le=1.0)
    seed: StrictInt | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # torch's range, as vLLM
    stop: Union[str, list[str], None] = None
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0)
    # 1 = off; above 2 every repeated token is all but ruled out (vLLM bounds it below only)
    repetition_penalty: StrictFloat = Field(default=1.0, gt=0.0, le=2.0)
    min_tokens: StrictInt = Field(default=0, ge=0)
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        if isinstance(value, list) and len(value) > 16:
            raise ValueError("at most 16 stop strings")
        if isinstance(value, list) and any(s == "" for s in value) or value == "":
            raise ValueError("stop strings must not be empty")
        return value

    # OpenAI's response_format, and vLLM's structured_outputs extra parameter (json, json_object,
    # regex, choice, grammar)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def ignored_fields(self) -> list[str]:
        """The request's fields llmopt does not read."""
        return sorted(self.model_extra or {})

    def check_supported(self) -> None:
        """Refuse a known field set to something llmopt cannot do (RequestError naming it)."""
        for name, value in (self.model_extra or {}).items():
            if name in self.refused and value not in UNSUPPORTED_FIELDS.get(name, (None, False)):
                hint = WHAT_INSTEAD.get(name, "llmopt serve does not implement it")
                raise RequestError(f"{name} is not supported ({hint})", param=name)

    def structured(self) -> StructuredOutputsParams | None:
        """The output constraint asked for, or None; RequestError if it is malformed."""
        if self.structured_outputs is not None and self.response_format is not None:
            raise RequestError("give response_format or structured_outputs, not both", param="response_format")
        if self.structured_outputs is not None:
            fields = {"json", "json_object", "regex", "choice", "grammar"}
            unknown = sorted(set(self.structured_outputs) - fields)
            if unknown:
                raise RequestError(f"structured_outputs.{unknown[0]} is not supported; use one of "
                                   f"{', '.join(sorted(fields))}", param="structured_outputs")
            kinds = {"json": (dict, str), "json_object": (bool,), "regex": (str,), "choice": (list,), "grammar": (str,)}
            for name, value in self.structured_outputs.items():
                if value is not None and not isinstance(value, kinds[name]):
                    raise RequestError(f"structured_outputs.{name} must be a "
                                       f"{' or '.join(_JSON_TYPES[t] for t in kinds[name])}", param="structured_outputs")
            try:
                return StructuredOutputsParams(**self.structured_outputs, strict=False)
            except LlmoptError as exc:
                raise RequestError(str(exc), param="structured_outputs") from None
        fmt = self.response_format
        if fmt is None or fmt.get("type", "text") == "text":
            return None
        if fmt.get("type") == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.get("type") == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise RequestError("response_format.json_schema must be an object with a 'schema' object",
                                   param="response_format")
            # OpenAI: a json_schema without a schema is any JSON object
            return StructuredOutputsParams(json=spec.get("schema") or {"type": "object"},
                                           strict=bool(spec.get("strict", False)))
        raise RequestError(f"response_format type {fmt.get('type')!r} is not supported; use text, json_object "
                           "or json_schema", param="response_format")

    # ---- what the endpoint asks of the engine (each endpoint's fields say it differently) ----
    prompt_field: ClassVar[str]  # the body field holding the prompt, named by errors about it

    def tokenized_prompts(self, engine: ServingEngine) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) of each prompt to run, `n` choices each; LlmoptError if one is unusable."""
        raise NotImplementedError

    @property
    def num_prompts(self) -> int:
        """How many prompts the request holds (each runs `n` sequences)."""
        return 1

    @property
    def max_tokens_wanted(self) -> int | None:
        """The output limit asked for; None: whatever context the prompt leaves."""
        return self.max_tokens

    @property
    def logprobs_wanted(self) -> int | None:
        """How many top alternatives each output token needs, or None for no logprobs."""
        return None

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        """How many top alternatives each prompt position needs, or None."""
        return None

    def param(self, engine_field: str | None) -> str | None:
        """The body field behind an engine field an error names (`LlmoptError.param`)."""
        if engine_field == "prompt":
            return self.prompt_field
        if engine_field == "structured_outputs" and self.structured_outputs is None:
            return "response_format"
        return engine_field

    def sampling_params(self, max_tokens: int, index: int,
                        structured: StructuredOutputsParams | None) -> SamplingParams:
        """Choice `index`'s parameters; `structured` is `self.structured()`, worked out once per request."""
        # n > 1 draws independent samples: with a seed, sample i uses seed + i
        seed = None if self.seed is None else self.seed + index
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                min_p=self.min_p, seed=seed, stop=self.stop, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                min_tokens=min(self.min_tokens, max_tokens), ignore_eos=self.ignore_eos,
                logprobs=self.logprobs_wanted, prompt_logprobs=self.prompt_logprobs_wanted,
                structured_outputs=structured,
            )
        except LlmoptError as exc:
            raise RequestError(str(exc)) from None


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Role
    content: Union[str, list[TextContentPart], None] = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a tool message answers

    @field_validator("role", mode="before")  # before the Literal's own check: our message names the role
    @classmethod
    def _role(cls, value: Any) -> Any:
        if not isinstance(value, str) or value not in ROLES:
            raise ValueError(f"unknown role {value!r}; expected one of {', '.join(sorted(ROLES))}")
        return value

    @field_validator("content", mode="before")  # image, audio, file parts: say so, not "not a string"
    @classmethod
    def _content(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"only text content parts are supported, got type {kind!r}")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [
        {"messages": [{"role": "user", "content": "Say this is a test"}], "max_tokens": 8, "temperature": 0},
        {"messages": [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "A pet?"}],
         "max_tokens": 16, "n": 2, "seed": 1, "logprobs": True, "top_logprobs": 2, "stream": True,
         "stream_options": {"include_usage": True}, "response_format": {"type": "json_object"}},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}], "max_tokens": 16,
         "response_format": {"type": "json_schema", "json_schema": {"name": "colour", "strict": True, "schema": {
             "type": "object", "properties": {"colour": {"enum": ["red", "blue"]}}, "required": ["colour"]}}}},
    ]})
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # OpenAI's default: "auto" with tools, "none" without
    parallel_tool_calls: StrictBool = True
    # vLLM scores chat prompts too; llmopt only on /v1/completions
    refused: ClassVar[tuple[str, ...]] = (*UNSUPPORTED_FIELDS, "prompt_logprobs", "echo")
    _tool_plan: ToolPlan | None = PrivateAttr(default=None)
    # how the history's calls are written when no plan says it (no tools, or tool_choice none)
    _history_format: tuple[Any, bool] = PrivateAttr(default=(None, False))

    prompt_field: ClassVar[str] = "messages"

    def chat_messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        for m in self.messages:
            message: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.tool_calls:
                message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.role == "tool":
                message["tool_call_id"] = m.tool_call_id
            messages.append(message)
        return messages

    def plan_tools(self, parser: str | None, chat_template: str | None, auto_allowed: bool = True) -> ToolPlan | None:
        """Check `tools`, `tool_choice` and the calls in the history (RequestError naming the field)
        and keep the plan the prompt and the output constraint follow."""
        try:
            tool_calls.check_history(self.chat_messages())
            plan = tool_calls.plan(self.tools, self.tool_choice, self.parallel_tool_calls, parser, chat_template)
        except LlmoptError as exc:
            raise RequestError(str(exc), param=exc.param) from None
        if plan is not None and plan.choice == "auto" and not auto_allowed:
            raise RequestError('"auto" tool choice requires the server to run with --enable-auto-tool-choice '
                               '(tool_choice "required" or a named function works without it)', param="tool_choice")
        self._tool_plan = plan
        self._history_format = (tool_calls.format_for(parser, chat_template),
                                tool_calls.template_knows_tools(chat_template))
        return plan

    @property
    def tool_plan(self) -> ToolPlan | None:
        return self._tool_plan

    def param(self, engine_field: str | None) -> str | None:
        if engine_field == "structured_outputs" and self._tool_plan is not None:
            return "tools"
        return super().param(engine_field)

    def structured(self) -> StructuredOutputsParams | None:
        plan = self._tool_plan
        if plan is None:
            return super().structured()
        if plan.forced and (self.response_format or {}).get("type", "text") != "text":
            raise RequestError("a required or named tool_choice cannot be combined with response_format",
                               param="response_format")
        if self.structured_outputs is not None:
            raise RequestError("tools cannot be combined with structured_outputs", param="structured_outputs")
        # with auto the answer is free text or calls; response_format would forbid the calls
        return StructuredOutputsParams(grammar=plan.grammar())

    def tokenized_prompts(self, engine: ServingEngine) -> list[tuple[str | None, list[int]]]:
        # message content stays text: special-token text in it is not read as a control token
        plan = self._tool_plan
        messages = tool_calls.render_history(self.chat_messages(), plan, *self._history_format)
        tools = [t.model_dump(exclude_none=True) for t in plan.tools] if plan and plan.template_knows_tools else None
        return [engine.tokenizer.chat_prompt(messages, add_generation_prompt=True, tools=tools)]

    @property
    def max_tokens_wanted(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingRequest):
    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [
        {"prompt": "Say this is a test", "max_tokens": 8, "temperature": 0},
        # how evaluation harnesses score choices: token-id prompts, echo, the prompt's logprobs
        {"prompt": [[1, 2, 3], [1, 2, 4]], "echo": True, "logprobs": 1, "max_tokens": 0},
        {"prompt": ["Once upon a time", "The capital of France is"], "max_tokens": 8, "n": 2, "stream": True,
         "stop": ["."], "logprobs": 2, "prompt_logprobs": 1},
        {"prompt": "The sky is", "max_tokens": 4, "structured_outputs": {"choice": ["blue", "grey"]}},
    ]})
    prompt: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]
    # 0 is allowed here: with echo (or prompt_logprobs) it scores the prompt alone
    max_tokens: StrictInt | None = Field(default=None, ge=0)
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)  # vLLM's extra parameter

    prompt_field: ClassVar[str] = "prompt"

    @property
    def max_tokens_wanted(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default

    @property
    def logprobs_wanted(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs_wanted(self) -> int | None:
        """echo + logprobs (OpenAI), prompt_logprobs (vLLM), or 0 when max_tokens is 0 (the request
        is only a prefill)."""
        wanted = [n for n in (self.logprobs if self.echo else None, self.prompt_logprobs) if n is not None]
        if wanted:
            return max(wanted)
        return 0 if self.max_tokens == 0 else None

    @property
    def num_prompts(self) -> int:
        return len(self.prompts())

    def tokenized_prompts(self, engine: ServingEngine) -> list[tuple[str | None, list[int]]]:
        return [engine.tokenize_prompt(prompt) for prompt in self.prompts()]

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise RequestError("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, max_length=MAX_MESSAGES)
    add_special_tokens: StrictBool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[StrictInt]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error object: what every refusal answers."""

    error: ErrorInfo


# the refusals every generating route can answer, for the OpenAPI document (`responses=`)
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request: a malformed body, a field out of range, a "
          "field llmopt cannot honour, or a prompt longer than the context"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key (servers started with --api-key)"},
    404: {"model": ErrorResponse, "description": "The model named is not the one served"},
    413: {"model": ErrorResponse, "description": "The request body is over the size limit"},
    503: {"model": ErrorResponse, "description": "Too many requests waiting; retry after the Retry-After header"},
}


class RequestError(Exception):
    """A request we refuse: becomes an OpenAI error object with a 4xx status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type_: Literal["invalid_request_error", "authentication_error", "not_found_error",
                                "server_busy"] = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type_, code


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
