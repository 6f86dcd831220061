"""OpenAI request schemas: what we read from a request, validated; unknown fields ignored."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llmopt.errors import LlmoptError
from llmopt.runtime import SamplingParams

MAX_N = 8
ROLES = {"system", "user", "assistant", "tool", "developer"}


class _Request(BaseModel):
    # OpenAI clients send fields we do not use (user, metadata, ...): accept and ignore them
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        if isinstance(value, list) and len(value) > 16:
            raise ValueError("at most 16 stop strings")
        if isinstance(value, list) and any(s == "" for s in value) or value == "":
            raise ValueError("stop strings must not be empty")
        return value

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def sampling_params(self, max_tokens: int, logprobs: int | None, index: int) -> SamplingParams:
        # n > 1 draws independent samples: with a seed, sample i uses seed + i
        seed = None if self.seed is None else self.seed + index
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                min_p=self.min_p, seed=seed, stop=self.stop, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                min_tokens=min(self.min_tokens, max_tokens), ignore_eos=self.ignore_eos, logprobs=logprobs,
            )
        except LlmoptError as exc:
            raise RequestError(str(exc)) from None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: Union[str, list[dict[str, Any]], None] = None

    @field_validator("role")
    @classmethod
    def _role(cls, value: str) -> str:
        if value not in ROLES:
            raise ValueError(f"unknown role {value!r}; expected one of {', '.join(sorted(ROLES))}")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError("only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None

    def chat_messages(self) -> list[dict[str, str]]:
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise RequestError("response_format other than 'text' is not supported yet", param="response_format")
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Request):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    suffix: str | None = None

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
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


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
