"""POST /v1/chat/completions: the chat template applied by the served model's tokenizer, `n`,
streaming, logprobs."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from llmopt.runtime.outputs import CompletionOutput
from llmopt.serve.protocol import ERROR_RESPONSES, ChatCompletionRequest
from llmopt.serve.serving import Job, Serving, ServingDep, finish_reason, sse, usage

router = APIRouter(tags=["chat"], responses=ERROR_RESPONSES)


@router.post("/v1/chat/completions", response_model=None,
             summary="OpenAI chat completions: a chat.completion, or server-sent chunks with stream: true")
async def chat_completions(body: ChatCompletionRequest, serving: ServingDep) -> dict[str, Any] | StreamingResponse:
    serving.check(body)
    prompt_ids, prompt_text = serving.tokenize_chat(body)
    max_tokens = serving.max_tokens(body.max_completion_tokens or body.max_tokens, len(prompt_ids), "messages")
    jobs = [Job(i, prompt_ids, prompt_text, max_tokens) for i in range(body.n)]
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    serving.start(jobs, body, logprobs)
    created, rid = int(time.time()), f"chatcmpl-{secrets.token_hex(12)}"
    if body.stream:
        return sse(_stream(serving, jobs, body, created, rid))
    finals = await serving.collect(jobs)
    choices = []
    for job in jobs:
        c = finals[job.index].outputs[0]
        choices.append({"index": job.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": _logprobs(serving, c.token_ids, c.logprobs, logprobs) if body.logprobs else None,
                        "finish_reason": finish_reason(c.finish_reason)})
    return {"id": rid, "object": "chat.completion", "created": created, "model": serving.config.served_model_name,
            "choices": choices, "usage": usage(jobs, finals)}


def _stream(serving: Serving, jobs: list[Job], body: ChatCompletionRequest, created: int,
            rid: str) -> AsyncIterator[str]:
    intro = [{"index": j.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
              "finish_reason": None} for j in jobs]

    def choice(job: Job, c: CompletionOutput, fresh: tuple[list[int], list[dict[int, float]]] | None,
               finish: str | None) -> dict[str, Any]:
        lp = _logprobs(serving, *fresh, body.top_logprobs or 0) if body.logprobs and fresh else None
        return {"index": job.index, "delta": {"content": c.new_text} if c.new_text else {}, "logprobs": lp,
                "finish_reason": finish}

    return serving.stream(jobs, body.include_usage, created, rid, "chat.completion.chunk", intro, choice)


def _logprobs(serving: Serving, token_ids: list[int], logprobs: list[dict[int, float]] | None,
              top_n: int | None) -> dict[str, Any]:
    """OpenAI's chat logprobs object: per token its text, logprob, bytes and the top N alternatives."""
    content = []
    for tid, lp in zip(token_ids, logprobs or []):
        text = serving.token_text(tid)
        # the sampler gives the chosen token plus the top N: report the N most likely
        top = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n or 0]
        content.append({"token": text, "logprob": lp[tid], "bytes": list(text.encode()),
                        "top_logprobs": [{"token": serving.token_text(t), "logprob": v,
                                          "bytes": list(serving.token_text(t).encode())} for t, v in top]})
    return {"content": content}
