"""GET /v1/models (the one served model), POST /tokenize and /detokenize (vLLM's)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from llmopt.serve.protocol import ERROR_RESPONSES, DetokenizeRequest, RequestError, TokenizeRequest
from llmopt.serve.request_path import ServingDep

router = APIRouter(tags=["models"])
# /tokenize and /detokenize name no model and sit outside /v1 (no API key): only a bad body is refused
_BAD_BODY = {400: ERROR_RESPONSES[400], 413: ERROR_RESPONSES[413]}


@router.get("/v1/models", responses={401: ERROR_RESPONSES[401]})
async def models(serving: ServingDep) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": serving.config.served_model_name, "object": "model", "created": 0,
                                        "owned_by": "llmopt", "max_model_len": serving.max_model_len}]}


@router.post("/tokenize", responses=_BAD_BODY)
async def tokenize(body: TokenizeRequest, serving: ServingDep) -> dict[str, Any]:
    tokenizer = serving.tokenizer
    if body.messages is not None:
        ids = tokenizer.encode_chat([{"role": m.role, "content": m.text()} for m in body.messages])
    elif body.prompt is not None:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        raise RequestError("give 'prompt' or 'messages'", param="prompt")
    return {"tokens": ids, "count": len(ids), "max_model_len": serving.max_model_len}


@router.post("/detokenize", responses=_BAD_BODY)
async def detokenize(body: DetokenizeRequest, serving: ServingDep) -> dict[str, Any]:
    tokenizer = serving.tokenizer
    bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise RequestError(f"token id {bad[0]} is outside the vocabulary", param="tokens")
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}
