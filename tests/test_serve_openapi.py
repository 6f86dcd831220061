"""The server's /openapi.json tells the truth: it documents every POST body and the error answers,
and schemathesis, generating valid and invalid requests from it, gets no 5xx from the app."""

from __future__ import annotations

import pytest

from llmopt.loader import load
from llmopt.runtime.async_engine import AsyncLLM
from llmopt.serve.app import ServeConfig, build_app

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

MODEL = "tiny"
# examples per operation and generation mode: 8 operations, ~300 calls, ~20 s on 2 cores
MAX_EXAMPLES = 25


@pytest.fixture(scope="module")
def app(tiny_models):
    # a short context keeps each generated request small (max_tokens defaults to what the context leaves)
    engine = AsyncLLM.from_spec(load(str(tiny_models["llama"]), dtype="float32"), num_kv_blocks=64, max_model_len=48,
                                max_num_seqs=8)
    yield build_app(engine, ServeConfig(served_model_name=MODEL))
    engine.shutdown()


def fuzz(app, max_examples: int) -> tuple[int, list[str]]:
    """Call every operation of `app`'s /openapi.json in process with schemathesis-generated requests,
    valid and invalid; (number of calls, a line per request answered with a 5xx or an exception)."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    calls, failures = 0, []
    for result in schema.get_all_operations():
        operation = result.ok()
        has_input = bool(operation.body) or bool(list(operation.iter_parameters()))
        modes = [schemathesis.GenerationMode.POSITIVE] + ([schemathesis.GenerationMode.NEGATIVE] if has_input else [])
        for mode in modes:
            # derandomized: the same requests every run; no shrinking: every failure is reported as found
            @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def call(case) -> None:
                nonlocal calls
                calls += 1
                try:
                    case.call_and_validate(checks=[not_a_server_error])
                except Exception as exc:  # a check's failure, or the app's own exception re-raised by the client
                    failures.append(f"{operation.label} ({mode.value}) {case.body!r}: {type(exc).__name__}: {exc}")

            call()
    return calls, failures


def test_openapi_documents_every_body_and_the_error_answers(app):
    from starlette.testclient import TestClient

    from llmopt.runtime.engine_protocol import ServingEngine

    assert isinstance(app.state.serving.engine, ServingEngine)

    with TestClient(app) as http:
        doc = http.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)  # invalid bodies are 400s, as OpenAI answers
            if method == "post":
                ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                assert ref.rsplit("/", 1)[1] in schemas
                assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    generating = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest"}
    for path, model in generating.items():
        operation = doc["paths"][path]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(model)
        assert {"400", "401", "404", "413", "503"} <= set(operation["responses"])
    assert schemas["CompletionRequest"]["additionalProperties"] is True  # clients' extra fields are accepted
    assert set(schemas["ErrorInfo"]["properties"]) == {"message", "type", "param", "code"}


def test_schemathesis_finds_no_server_errors(app):
    calls, failures = fuzz(app, MAX_EXAMPLES)
    assert calls > 100
    assert not failures, "\n".join(failures[:10])


def test_the_fuzzer_reports_a_route_that_fails(tiny_models):
    """The harness above can fail: an engine that raises while tokenizing gives 5xx on /v1/completions."""
    engine = AsyncLLM.from_spec(load(str(tiny_models["llama"]), dtype="float32"), num_kv_blocks=16, max_model_len=48)

    def broken(prompt):
        raise RuntimeError("boom")

    engine.tokenize_prompt = broken
    try:
        calls, failures = fuzz(build_app(engine, ServeConfig(served_model_name=MODEL)), 5)
    finally:
        engine.shutdown()
    assert calls > 0
    assert any(line.startswith("POST /v1/completions") for line in failures), failures[:3]
    assert not any(line.startswith("POST /v1/chat/completions") for line in failures), failures[:3]
