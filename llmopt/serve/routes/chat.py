"""POST /v1/chat/completions: the chat template applied by the served model's tokenizer, `n`,
streaming, logprobs, tool calls (`llmopt.serve.tools`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from llmopt.runtime.outputs import CompletionOutput, RequestOutput
from llmopt.serve.protocol import ERROR_RESPONSES, ChatCompletionRequest
from llmopt.serve.response_bodies import ChatCompletion, ChatCompletionChunk, ok_response
from llmopt.serve.request_path import Choice, FreshTokens, Renderer, ServingDep, closure, finish_reason
from llmopt.serve.tools import CallStream, ToolPlan, new_call_id, read

router = APIRouter(tags=["chat"], responses=ERROR_RESPONSES)


@router.post("/v1/chat/completions", response_model=None,
             responses=ok_response(ChatCompletion, ChatCompletionChunk, "A chat.completion"),
             summary="OpenAI chat completions: a chat.completion, or server-sent chunks with stream: true")
async def chat_completions(body: ChatCompletionRequest, serving: ServingDep) -> dict[str, Any] | StreamingResponse:
    config = serving.config
    body.plan_tools(config.tool_call_parser, serving.tokenizer.chat_template, config.enable_auto_tool_choice)
    return await serving.respond(await serving.prepare(body), ChatRenderer(serving, body))


@dataclass
class ChatRenderer(Renderer):
    body: ChatCompletionRequest
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"
    calls: dict[int, CallStream] = field(default_factory=dict)  # each streamed choice's calls so far

    @property
    def plan(self) -> ToolPlan | None:
        return self.body.tool_plan

    def choice(self, choice: Choice, out: RequestOutput) -> dict[str, Any]:
        c = out.outputs[0]
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        reason = finish_reason(c.finish_reason)
        if self.plan is not None:
            # a call cut by max_tokens (output_closure "unclosable") is left out: a returned call
            # always parses
            snap = read(c.text, self.plan.format, final=True)
            calls = [call for call in snap.calls if call.complete]
            if calls:
                message = {"role": "assistant", "content": snap.content or None,
                           "tool_calls": [{"id": new_call_id(), "type": "function",
                                           "function": {"name": call.name, "arguments": call.arguments}}
                                          for call in calls]}
                reason = "tool_calls" if reason == "stop" else reason
            else:
                message["content"] = snap.content
        return {"index": choice.index, "message": message,
                "logprobs": self._logprobs(c.token_ids, c.logprobs) if self.body.logprobs else None,
                "finish_reason": reason, "output_closure": c.output_closure}

    def intro(self, choice: Choice) -> dict[str, Any]:
        return {"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def delta(self, choice: Choice, c: CompletionOutput, fresh: FreshTokens, finish: str | None) -> dict[str, Any]:
        lp = self._logprobs(*fresh) if self.body.logprobs and fresh else None
        if self.plan is None:
            return closure({"index": choice.index, "delta": {"content": c.new_text} if c.new_text else {},
                            "logprobs": lp, "finish_reason": finish}, c)
        # as OpenAI streams calls: the first delta of a call has its id, type and name, later ones
        # append to its arguments
        stream = self.calls.setdefault(choice.index, CallStream(self.plan.format))
        content, calls = stream.update(c.text, final=finish is not None)
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [{"index": d.index, "id": d.id, "type": "function",
                                    "function": {"name": d.name, "arguments": d.arguments}} if d.opened else
                                   {"index": d.index, "function": {"arguments": d.arguments}} for d in calls]
        if finish == "stop" and stream.complete_calls:
            finish = "tool_calls"
        return closure({"index": choice.index, "delta": delta, "logprobs": lp, "finish_reason": finish}, c)

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None) -> dict[str, Any]:
        """OpenAI's chat logprobs object: per token its text, logprob, bytes and the top N alternatives."""
        token_text, top_n = self.serving.token_text, self.body.top_logprobs or 0
        content = []
        for tid, lp in zip(token_ids, logprobs or []):
            text = token_text(tid)
            # the sampler gives the chosen token plus the top N: report the N most likely
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]
            content.append({"token": text, "logprob": lp[tid], "bytes": list(text.encode()),
                            "top_logprobs": [{"token": token_text(t), "logprob": v,
                                              "bytes": list(token_text(t).encode())} for t, v in top]})
        return {"content": content}
