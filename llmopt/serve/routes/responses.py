"""POST /v1/responses: OpenAI's Responses API, stateless. The request runs as the chat completion
it translates to (`llmopt.serve.responses_protocol`); the answer is a `response` object whose
`output` holds a message item and/or `function_call` items, or, with `stream: true`, the
server-sent events the OpenAI SDK parses (`response.created`, `response.output_item.added`,
`response.output_text.delta`, `response.function_call_arguments.delta`, ...,
`response.completed`)."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from llmopt.runtime.outputs import RequestOutput
from llmopt.serve.protocol import ERROR_RESPONSES, ChatCompletionRequest
from llmopt.serve.response_bodies import Response, ResponseStreamEvent, ok_response
from llmopt.serve.request_path import CheckedRequest, Serving, ServingDep
from llmopt.serve.responses_protocol import ResponsesRequest
from llmopt.serve.tools import CallStream, read

router = APIRouter(tags=["responses"], responses=ERROR_RESPONSES)


@router.post("/v1/responses", response_model=None,
             responses=ok_response(Response, ResponseStreamEvent, "A response"),
             summary="OpenAI Responses API (stateless): a response, or server-sent events with stream: true")
async def responses(body: ResponsesRequest, serving: ServingDep) -> dict[str, Any] | StreamingResponse:
    chat = body.chat_request()
    config = serving.config
    chat.plan_tools(config.tool_call_parser, serving.tokenizer.chat_template, config.enable_auto_tool_choice)
    checked = await serving.prepare(chat)
    serving.start(checked)
    answer = ResponseWriter(serving, body, chat, checked)
    if body.stream:
        return StreamingResponse(answer.events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    finals = await serving.collect(checked.choices)
    return answer.response(finals[0])


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass
class ResponseWriter:
    """One response: its object, its output items, its stream of events."""

    serving: Serving
    body: ResponsesRequest
    chat: ChatCompletionRequest
    checked: CheckedRequest
    id: str = field(default_factory=lambda: _id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    message_id: str = field(default_factory=lambda: _id("msg"))

    def envelope(self, status: str, output: list[dict[str, Any]], out: RequestOutput | None) -> dict[str, Any]:
        """The `response` object (`usage` once the output is done)."""
        body = self.body
        doc: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.serving.config.served_model_name, "output": output, "error": None,
            "incomplete_details": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": None, "store": False,
            "temperature": self.chat.temperature, "top_p": self.chat.top_p,
            "tool_choice": body.tool_choice if isinstance(body.tool_choice, str | None) else body.tool_choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []], "text": body.text or {"format": {"type": "text"}},
            "truncation": "disabled", "metadata": {}, "usage": None,
        }
        if doc["tool_choice"] is None:
            doc["tool_choice"] = "auto"
        if status == "incomplete":
            closed = out.outputs[0].output_closure if out is not None else None
            doc["incomplete_details"] = {"reason": "max_output_tokens", "output_closure": closed}
        if out is not None:
            prompt, completion = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
            doc["usage"] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": prompt + completion}
        return doc

    def message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [] if status == "in_progress" else [self.text_part(text)]
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant", "content": content}

    @staticmethod
    def text_part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
        return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
                "status": status}

    @staticmethod
    def status(out: RequestOutput) -> str:
        return "incomplete" if out.outputs[0].finish_reason == "length" else "completed"

    def response(self, out: RequestOutput) -> dict[str, Any]:
        text, plan = out.outputs[0].text, self.chat.tool_plan
        output: list[dict[str, Any]] = []
        if plan is None:
            output.append(self.message_item(text))
        else:
            # a call cut by max_output_tokens (output_closure "unclosable") is left out: a returned
            # call always parses
            snap = read(text, plan.format, final=True)
            calls = [call for call in snap.calls if call.complete]
            if snap.content or not calls:
                output.append(self.message_item(snap.content))
            output += [self.call_item(_id("fc"), _id("call"), c.name, c.arguments) for c in calls]
        return self.envelope(self.status(out), output, out)

    async def events(self) -> AsyncIterator[str]:
        """The response's server-sent events, each with its `sequence_number`."""
        sequence = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal sequence
            doc = {"type": kind, "sequence_number": sequence, **fields}
            sequence += 1
            return f"event: {kind}\ndata: {json.dumps(doc)}\n\n"

        yield event("response.created", response=self.envelope("in_progress", [], None))
        yield event("response.in_progress", response=self.envelope("in_progress", [], None))
        plan = self.chat.tool_plan
        calls = CallStream(plan.format) if plan is not None else None
        output: list[dict[str, Any]] = []  # finished items
        text = ""  # the open message's text
        message_open = False
        call_open: dict[str, Any] | None = None  # the call item being written
        final: RequestOutput | None = None

        def close_message() -> list[str]:
            nonlocal message_open
            message_open = False
            index = len(output)
            output.append(self.message_item(text))
            where = {"item_id": self.message_id, "output_index": index}
            return [event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]),
                    event("response.content_part.done", **where, content_index=0, part=self.text_part(text)),
                    event("response.output_item.done", output_index=index, item=output[-1])]

        def open_message() -> list[str]:
            nonlocal message_open
            message_open = True
            index = len(output)
            return [event("response.output_item.added", output_index=index,
                          item=self.message_item("", "in_progress")),
                    event("response.content_part.added", item_id=self.message_id, output_index=index,
                          content_index=0, part=self.text_part(""))]

        def close_call() -> list[str]:
            nonlocal call_open
            item, call_open = {**call_open, "status": "completed"}, None  # type: ignore[dict-item]
            index = len(output)
            output.append(item)
            return [event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                          name=item["name"], arguments=item["arguments"]),
                    event("response.output_item.done", output_index=index, item=item)]

        async for _choice, out in self.serving.outputs(self.checked.choices):
            c = out.outputs[0]
            if calls is None:
                new_text, deltas = c.new_text, []
            else:
                new_text, deltas = calls.update(c.text, final=out.finished)
            if new_text:
                if not message_open:
                    for e in open_message():
                        yield e
                text += new_text
                yield event("response.output_text.delta", item_id=self.message_id, output_index=len(output),
                            content_index=0, delta=new_text, logprobs=[])
            for d in deltas:
                if d.opened:
                    for e in (close_message() if message_open else []) + (close_call() if call_open else []):
                        yield e
                    call_open = self.call_item(_id("fc"), d.id, d.name, "", "in_progress")
                    yield event("response.output_item.added", output_index=len(output), item=dict(call_open))
                if d.arguments:
                    call_open["arguments"] += d.arguments  # type: ignore[index]
                    yield event("response.function_call_arguments.delta", item_id=call_open["id"],  # type: ignore[index]
                                output_index=len(output), delta=d.arguments)
            if out.finished:
                final = out
        assert final is not None
        if call_open is not None and calls is not None and calls.complete_calls < len(calls.ids):
            call_open = None  # cut by max_output_tokens: not returned
        for e in (close_message() if message_open else []) + (close_call() if call_open else []):
            yield e
        if not output:  # nothing written: an empty message, as the whole response has
            for e in open_message() + close_message():
                yield e
        status = self.status(final)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield event(kind, response=self.envelope(status, output, final))
