"""GET /v1/models (the one served model), POST /tokenize and /detokenize (vLLM's)."""

from __future__ import annotations

import functools
from typing import Any

from fastapi import APIRouter

from llmopt.serve.protocol import ERROR_RESPONSES, DetokenizeRequest, RequestError, TokenizeRequest
from llmopt.serve.request_path import ServingDep

router = APIRouter(tags=["models"])
# /tokenize and /detokenize name no model: a bad body or a missing key (with --api-key) is refused
_BAD_BODY = {400: ERROR_RESPONSES[400], 401: ERROR_RESPONSES[401], 413: ERROR_RESPONSES[413]}


@router.get("/v1/models", responses={401: ERROR_RESPONSES[401]})
async def models(serving: ServingDep) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": serving.config.served_model_name, "object": "model", "created": 0,
                                        "owned_by": "llmopt", "max_model_len": serving.max_model_len}]}


@router.post("/tokenize", responses=_BAD_BODY)
async def tokenize(body: TokenizeRequest, serving: ServingDep) -> dict[str, Any]:
    # on a worker thread: a long text or a long chat's template costs seconds
    ids = await serving.preparer.run(functools.partial(_tokenize, body, serving.tokenizer), "tokenizing")
    return {"tokens": ids, "count": len(ids), "max_model_len": serving.max_model_len}


def _tokenize(body: TokenizeRequest, tokenizer: Any) -> list[int]:
    if body.messages is not None:
        return tokenizer.encode_chat([{"role": m.role, "content": m.text()} for m in body.messages])
    if body.prompt is not None:
        return tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    raise RequestError("give 'prompt' or 'messages'", param="prompt")


@router.post("/detokenize", responses=_BAD_BODY)
async def detokenize(body: DetokenizeRequest, serving: ServingDep) -> dict[str, Any]:
    text = await serving.preparer.run(functools.partial(_detokenize, body.tokens, serving.tokenizer), "detokenizing")
    return {"prompt": text}


def _detokenize(tokens: list[int], tokenizer: Any) -> str:
    vocab_size = tokenizer.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary", param="tokens")
    return tokenizer.decode(tokens, skip_special_tokens=False)
