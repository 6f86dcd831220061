"""GET /health (200 while serving), /version, /metrics (Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from llmopt import __version__
from llmopt.serve.request_path import ServingDep

router = APIRouter(tags=["health"])


@router.get("/health", response_class=Response, responses={200: {"description": "The server is up"}})
async def health() -> Response:
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus metrics (`llmopt:` prefix)"}})
async def metrics(serving: ServingDep) -> Response:
    return Response(serving.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
