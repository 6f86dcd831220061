"""POST /v1/completions: text or token-id prompts (several per request), `n`, streaming, logprobs,
and prompt scoring (`echo` + `logprobs`, vLLM's `prompt_logprobs`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from llmopt.runtime.outputs import CompletionOutput, RequestOutput
from llmopt.serve.protocol import ERROR_RESPONSES, CompletionRequest
from llmopt.serve.response_bodies import TextCompletion, ok_response
from llmopt.serve.request_path import Choice, FreshTokens, Renderer, ServingDep, closure, finish_reason

router = APIRouter(tags=["completions"], responses=ERROR_RESPONSES)

# a prompt position's scores: None (the first) or {token id: logprob} for the token and the top N
PromptScores = list[dict[int, float] | None] | None


@router.post("/v1/completions", response_model=None,
             responses=ok_response(TextCompletion, TextCompletion, "A text_completion"),
             summary="OpenAI completions: a text_completion, or server-sent chunks with stream: true")
async def completions(body: CompletionRequest, serving: ServingDep) -> dict[str, Any] | StreamingResponse:
    return await serving.respond(await serving.prepare(body), CompletionRenderer(serving, body))


class CompletionRenderer(Renderer):
    body: CompletionRequest
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl-"

    @property
    def scored(self) -> bool:
        """Whether the answer carries the prompt's scores: a stream sends them with a choice's first output."""
        body = self.body
        return body.prompt_logprobs_wanted is not None and (body.logprobs is not None
                                                            or body.prompt_logprobs is not None)

    def choice(self, choice: Choice, out: RequestOutput) -> dict[str, Any]:
        body, c = self.body, out.outputs[0]
        doc: dict[str, Any] = {"index": choice.index,
                               "text": (self.serving.echo_text(choice) if body.echo else "") + c.text,
                               "logprobs": None, "finish_reason": finish_reason(c.finish_reason),
                               "output_closure": c.output_closure}
        if body.logprobs is not None:
            prompt = (choice.prompt_ids, out.prompt_logprobs) if body.echo else None
            doc["logprobs"] = self._logprobs(c.token_ids, c.logprobs, prompt)
        if body.prompt_logprobs is not None:
            doc["prompt_logprobs"] = self._vllm_prompt_logprobs(choice.prompt_ids, out.prompt_logprobs)
        return doc

    def intro(self, choice: Choice) -> dict[str, Any] | None:
        # the echoed prompt comes first; with its logprobs it waits for the prefill that computes them
        if not self.body.echo or self.scored:
            return None
        return {"index": choice.index, "text": self.serving.echo_text(choice), "logprobs": None,
                "finish_reason": None}

    def opening(self, choice: Choice, out: RequestOutput) -> dict[str, Any] | None:
        if not self.scored:
            return None
        body = self.body
        first: dict[str, Any] = {"index": choice.index, "text": self.serving.echo_text(choice) if body.echo else "",
                                 "logprobs": None, "finish_reason": None}
        if body.echo and body.logprobs is not None:
            first["logprobs"] = self._logprobs([], [], (choice.prompt_ids, out.prompt_logprobs))
        if body.prompt_logprobs is not None:
            first["prompt_logprobs"] = self._vllm_prompt_logprobs(choice.prompt_ids, out.prompt_logprobs)
        return first

    def delta(self, choice: Choice, c: CompletionOutput, fresh: FreshTokens, finish: str | None) -> dict[str, Any]:
        lp = self._logprobs(*fresh) if self.body.logprobs is not None and fresh else None
        return closure({"index": choice.index, "text": c.new_text, "logprobs": lp, "finish_reason": finish}, c)

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                  prompt: tuple[list[int], PromptScores] | None = None) -> dict[str, Any]:
        """OpenAI's legacy logprobs object; with `prompt` (echo): its (token ids, prompt logprobs) first,
        the first position's logprob and alternatives null, as OpenAI and vLLM give them."""
        token_text, top_n = self.serving.token_text, self.body.logprobs or 0
        pairs: list[tuple[int, dict[int, float] | None]] = list(zip(*prompt)) if prompt is not None else []
        pairs += list(zip(token_ids, logprobs or []))
        tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
        for tid, lp in pairs:
            text = token_text(tid)
            tokens.append(text)
            token_lps.append(None if lp is None else lp[tid])
            # the runtime gives the token plus the top N: report the N most likely (plus the token)
            top = None if lp is None else dict(sorted(lp.items(), key=lambda kv: -kv[1])[:top_n])
            if top is not None and lp is not None:
                top.setdefault(tid, lp[tid])
            tops.append(None if top is None else {token_text(t): v for t, v in top.items()})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _vllm_prompt_logprobs(self, prompt_ids: list[int],
                              scores: PromptScores) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id: {logprob,
        decoded_token}} for the prompt token and the top N."""
        top_n = self.body.prompt_logprobs or 0
        result: list[dict[str, dict[str, Any]] | None] = []
        for tid, lp in zip(prompt_ids, scores or []):
            if lp is None:
                result.append(None)
                continue
            top = dict(sorted(lp.items(), key=lambda kv: -kv[1])[:top_n])
            top.setdefault(tid, lp[tid])
            result.append({str(t): {"logprob": v, "decoded_token": self.serving.token_text(t)} for t, v in top.items()})
        return result
