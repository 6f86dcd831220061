"""POST /v1/completions: text or token-id prompts (several per request), `n`, streaming, logprobs,
and prompt scoring (`echo` + `logprobs`, vLLM's `prompt_logprobs`)."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from llmopt.runtime.outputs import CompletionOutput, RequestOutput
from llmopt.serve.protocol import ERROR_RESPONSES, CompletionRequest
from llmopt.serve.serving import Job, Serving, ServingDep, finish_reason, sse, usage

router = APIRouter(tags=["completions"], responses=ERROR_RESPONSES)

# a prompt position's scores: None (the first) or {token id: logprob} for the token and the top N
PromptScores = list[dict[int, float] | None] | None


@router.post("/v1/completions", response_model=None,
             summary="OpenAI completions: a text_completion, or server-sent chunks with stream: true")
async def completions(body: CompletionRequest, serving: ServingDep) -> dict[str, Any] | StreamingResponse:
    serving.check(body)
    jobs: list[Job] = []
    max_tokens = 16 if body.max_tokens is None else body.max_tokens  # OpenAI's default
    for p_index, prompt in enumerate(body.prompts()):
        text, ids = serving.tokenize_prompt(prompt)
        for k in range(body.n):
            jobs.append(Job(p_index * body.n + k, ids, text, serving.max_tokens(max_tokens, len(ids), "prompt")))
    serving.start(jobs, body, body.logprobs, body.prompt_logprobs_wanted)
    created, rid = int(time.time()), f"cmpl-{secrets.token_hex(12)}"
    if body.stream:
        return sse(_stream(serving, jobs, body, created, rid))
    finals = await serving.collect(jobs)
    choices = []
    for job in jobs:
        out = finals[job.index]
        c = out.outputs[0]
        choice: dict[str, Any] = {"index": job.index, "text": (serving.echo_text(job) if body.echo else "") + c.text,
                                  "logprobs": None, "finish_reason": finish_reason(c.finish_reason)}
        if body.logprobs is not None:
            prompt = (job.prompt_ids, out.prompt_logprobs) if body.echo else None
            choice["logprobs"] = _logprobs(serving, c.token_ids, c.logprobs, body.logprobs, prompt)
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = _vllm_prompt_logprobs(serving, job.prompt_ids, out.prompt_logprobs,
                                                              body.prompt_logprobs)
        choices.append(choice)
    return {"id": rid, "object": "text_completion", "created": created, "model": serving.config.served_model_name,
            "choices": choices, "usage": usage(jobs, finals)}


def _stream(serving: Serving, jobs: list[Job], body: CompletionRequest, created: int, rid: str) -> AsyncIterator[str]:
    scored = body.prompt_logprobs_wanted is not None and (body.logprobs is not None
                                                          or body.prompt_logprobs is not None)
    # the echoed prompt comes first; with its logprobs it waits for the prefill that computes them
    intro = [{"index": j.index, "text": serving.echo_text(j), "logprobs": None, "finish_reason": None}
             for j in jobs] if body.echo and not scored else []

    def opening(job: Job, out: RequestOutput) -> dict[str, Any]:
        first: dict[str, Any] = {"index": job.index, "text": serving.echo_text(job) if body.echo else "",
                                 "logprobs": None, "finish_reason": None}
        if body.echo and body.logprobs is not None:
            first["logprobs"] = _logprobs(serving, [], [], body.logprobs, (job.prompt_ids, out.prompt_logprobs))
        if body.prompt_logprobs is not None:
            first["prompt_logprobs"] = _vllm_prompt_logprobs(serving, job.prompt_ids, out.prompt_logprobs,
                                                             body.prompt_logprobs)
        return first

    def choice(job: Job, c: CompletionOutput, fresh: tuple[list[int], list[dict[int, float]]] | None,
               finish: str | None) -> dict[str, Any]:
        lp = _logprobs(serving, *fresh, body.logprobs) if body.logprobs is not None and fresh else None
        return {"index": job.index, "text": c.new_text, "logprobs": lp, "finish_reason": finish}

    return serving.stream(jobs, body.include_usage, created, rid, "text_completion", intro, choice,
                          opening if scored else None)


def _logprobs(serving: Serving, token_ids: list[int], logprobs: list[dict[int, float]] | None, top_n: int,
              prompt: tuple[list[int], PromptScores] | None = None) -> dict[str, Any]:
    """OpenAI's legacy logprobs object; with `prompt` (echo): its (token ids, prompt logprobs) first,
    the first position's logprob and alternatives null, as OpenAI and vLLM give them."""
    pairs: list[tuple[int, dict[int, float] | None]] = list(zip(*prompt)) if prompt is not None else []
    pairs += list(zip(token_ids, logprobs or []))
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    for tid, lp in pairs:
        text = serving.token_text(tid)
        tokens.append(text)
        token_lps.append(None if lp is None else lp[tid])
        # the runtime gives the token plus the top N: report the N most likely (plus the token)
        top = None if lp is None else dict(sorted(lp.items(), key=lambda kv: -kv[1])[:top_n])
        if top is not None and lp is not None:
            top.setdefault(tid, lp[tid])
        tops.append(None if top is None else {serving.token_text(t): v for t, v in top.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _vllm_prompt_logprobs(serving: Serving, prompt_ids: list[int], scores: PromptScores,
                          top_n: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id: {logprob,
    decoded_token}} for the prompt token and the top N."""
    result: list[dict[str, dict[str, Any]] | None] = []
    for tid, lp in zip(prompt_ids, scores or []):
        if lp is None:
            result.append(None)
            continue
        top = dict(sorted(lp.items(), key=lambda kv: -kv[1])[:top_n])
        top.setdefault(tid, lp[tid])
        result.append({str(t): {"logprob": v, "decoded_token": serving.token_text(t)} for t, v in top.items()})
    return result
