"""Client-side helpers shared by everything that talks to an OpenAI-compatible server over HTTP
(`bench serve`, `eval --base-url`): the base URL, and the served model's name from `/v1/models`."""

from __future__ import annotations

import httpx

from llmopt.errors import LlmoptError


def base_url(url: str, flag: str = "--url") -> str:
    """'http://h:p/v1/' -> 'http://h:p': the endpoints are added to this."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise LlmoptError(f"{flag} must start with http:// or https://, got {url!r}")
    return url.removesuffix("/v1")


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def probe(url: str, api_key: str | None = None, served_model_name: str | None = None, timeout: float = 10.0) -> str:
    """The model name to send: `served_model_name`, else the first id `/v1/models` lists.
    Raises LlmoptError when the server cannot be reached or refuses us."""
    try:
        response = httpx.get(url + "/v1/models", headers=auth_headers(api_key), timeout=timeout)
    except httpx.HTTPError as exc:
        raise LlmoptError(f"cannot reach {url}/v1/models: {type(exc).__name__}: {exc or 'no answer'}") from None
    if response.status_code in (401, 403):
        raise LlmoptError(f"{url}/v1/models answered HTTP {response.status_code}: pass the server's key with --api-key")
    if served_model_name:
        return served_model_name
    try:
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        raise LlmoptError(f"{url}/v1/models (HTTP {response.status_code}) lists no model: "
                          "give --served-model-name") from None
