"""POST /v1/chat/completions: the chat template applied by the served model's tokenizer, `n`,
streaming, logprobs."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from llmopt.runtime.outputs import CompletionOutput, RequestOutput
from llmopt.serve.protocol import ERROR_RESPONSES, ChatCompletionRequest
from llmopt.serve.request_path import Choice, FreshTokens, Renderer, ServingDep, finish_reason

router = APIRouter(tags=["chat"], responses=ERROR_RESPONSES)


@router.post("/v1/chat/completions", response_model=None,
             summary="OpenAI chat completions: a chat.completion, or server-sent chunks with stream: true")
async def chat_completions(body: ChatCompletionRequest, serving: ServingDep) -> dict[str, Any] | StreamingResponse:
    return await serving.respond(await serving.prepare(body), ChatRenderer(serving, body))


class ChatRenderer(Renderer):
    body: ChatCompletionRequest
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def choice(self, choice: Choice, out: RequestOutput) -> dict[str, Any]:
        c = out.outputs[0]
        return {"index": choice.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": self._logprobs(c.token_ids, c.logprobs) if self.body.logprobs else None,
                "finish_reason": finish_reason(c.finish_reason)}

    def intro(self, choice: Choice) -> dict[str, Any]:
        return {"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def delta(self, choice: Choice, c: CompletionOutput, fresh: FreshTokens, finish: str | None) -> dict[str, Any]:
        lp = self._logprobs(*fresh) if self.body.logprobs and fresh else None
        return {"index": choice.index, "delta": {"content": c.new_text} if c.new_text else {}, "logprobs": lp,
                "finish_reason": finish}

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
