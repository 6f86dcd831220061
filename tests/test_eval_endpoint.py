"""`llmopt eval --base-url`: a served model scored through /v1/completions equals the in-process result,
and the probe refuses endpoints whose prompt log-probabilities cannot be trusted (exit 2, problem named)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from conftest import run_cli

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
from fastapi import Request  # noqa: E402  (module level: the handler's annotation must resolve)

TEXT = (
    "The quick brown fox jumps over the lazy dog. Then the dog wakes up and chases the fox into the woods, "
    "where the trees are tall and the air is cold. "
) * 6


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # tiny matmuls on busy shared cores run tens of times faster on one thread
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_models) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval-endpoint")
    (root / "text.txt").write_text(TEXT, encoding="utf-8")
    records = [{"subject": s, "question": f"What is {i} plus {i}?", "choices": [str(2 * i), str(i), str(3 * i), "7"],
                "answer": i % 4} for s in ("anatomy", "virology") for i in range(4)]
    (root / "mmlu.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    # the candidate: the tiny llama with noise added, so that ppl and KLD differ from the baseline's
    from safetensors.torch import load_file, save_file

    noisy = root / "llama-noisy"
    shutil.copytree(tiny_models["llama"], noisy)
    tensors = load_file(noisy / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    save_file({k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in tensors.items()},
              noisy / "model.safetensors", metadata={"format": "pt"})
    return {"text": root / "text.txt", "mmlu": root / "mmlu.jsonl", "noisy": noisy}


def _eval(*args: str) -> tuple[int, dict, str]:
    code, err, out = run_cli("eval", *args, "--json", "--no-cache", "--gate", "none")
    assert "Traceback" not in err, err
    return code, json.loads(out) if code in (0, 1) else {}, err


# ---------------------------------------------------------------------------- the real server


@pytest.fixture(scope="module")
def served(files):
    from test_serve import start_server

    # ieee as the in-process side (the suite pins auto to ieee; a server process would resolve it per CPU)
    proc, base = start_server(str(files["noisy"]), "--kv-cache-memory", "64MiB", "--max-model-len", "256",
                              "--fp32-matmul-precision", "ieee")
    yield base
    proc.terminate()
    proc.wait(timeout=20)


def test_base_url_against_llmopt_serve_equals_the_in_process_result(tiny_models, files, served):
    common = ("--baseline", str(tiny_models["llama"]), "--tasks", "ppl,kld,mmlu", "--text", str(files["text"]),
              "--ctx-size", "64", "--mmlu-path", str(files["mmlu"]))
    code, local, err = _eval(str(files["noisy"]), *common)
    assert code == 0, err
    code, remote, err = _eval("--base-url", served + "/v1", *common)
    assert code == 0, err
    assert remote["llmopt"]["model"]["kind"] == "endpoint" and remote["llmopt"]["model"]["tokenizer"] == str(tiny_models["llama"])
    ppl_local, ppl_remote = local["results"]["ppl"]["ppl,none"], remote["results"]["ppl"]["ppl,none"]
    assert ppl_local > 1.5 * local["llmopt"]["baseline_results"]["ppl"]["ppl"]  # the noise shows
    assert abs(ppl_remote - ppl_local) <= 1e-3 * ppl_local, (ppl_local, ppl_remote)
    assert remote["n-samples"]["ppl"] == local["n-samples"]["ppl"]
    # MMLU: the same four log-likelihoods per question, so the same picks
    assert remote["results"]["mmlu"]["acc,none"] == local["results"]["mmlu"]["acc,none"]
    # KLD from the top-20 + one tail bucket: a lower bound of the full KLD (this random model's flat rows put
    # most of their mass outside any top 20, so the bound is loose here); same top and Δp are exact
    k_local, k_remote = local["llmopt"]["results"]["kld"], remote["llmopt"]["results"]["kld"]
    assert 0.01 < k_remote["mean"] <= k_local["mean"] + 1e-6
    # a bound at every position bounds every order statistic too
    for key in ("max", "p99", "p90", "median", "p10", "min"):
        assert k_remote[key] <= k_local[key] + 1e-6, key
    # same top is exact where the endpoint names its top token by a text one id has (this byte-level vocabulary
    # has many '\ufffd' pieces, which stay in the tail)
    assert abs(k_remote["same_top_p"] - k_local["same_top_p"]) <= 0.02
    assert abs(k_remote["delta_p"]["mean"] - k_local["delta_p"]["mean"]) < 1e-4
    assert "lower bound" in remote["configs"]["kld"]["candidate_logprobs"]


# ---------------------------------------------------------------------------- fake servers


class FakeServer:
    """A scripted OpenAI server in a thread, scoring with the tiny model: `mode` says how it is broken."""

    def __init__(self, model_dir: Path, mode: str):
        from fastapi.responses import JSONResponse

        from llmopt.loader import load

        self.loaded = load(str(model_dir), dtype="float32")
        self.mode = mode
        app = fastapi.FastAPI()

        @app.get("/v1/models")
        def models():
            return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            prompt = body["prompt"]
            if self.mode == "text-only" and not isinstance(prompt, str):
                return JSONResponse({"detail": "prompt: Input should be a valid string"}, status_code=500)
            ids = self.loaded.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt
            return self.answer(ids, body)

        self.port = _free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                break
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), vocab] log-softmax rows: row i predicts token i + 1."""
        from llmopt.eval.metrics.loglikelihood import PackedAttention

        with torch.inference_mode():
            hidden = self.loaded.model(torch.tensor(ids), torch.arange(len(ids)), PackedAttention([len(ids)]))
            return torch.log_softmax(self.loaded.model.compute_logits(hidden).float(), dim=-1)

    def answer(self, ids: list[int], body: dict) -> dict:
        rows = self.logprobs(ids)
        g = int(rows[-1].argmax())
        text = lambda t: self.loaded.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
        k = max(1, int(body.get("logprobs") or 1))

        def top(row: torch.Tensor) -> dict[str, float]:
            values, idx = row.topk(k)
            return {text(int(i)): float(v) for v, i in zip(values, idx)}

        tokens, values, tops = [text(g)], [float(rows[-1, g])], [top(rows[-1])]
        if body.get("echo") and self.mode == "text-only":
            # llama-cpp-python 0.3 (llama.py, _create_completion): position i read off row i (which predicts
            # token i + 1), its top alternatives too, the first nulled; the generated token left out
            tokens = [text(t) for t in ids]
            values = [None] + [float(rows[i, t]) for i, t in enumerate(ids) if i > 0]
            tops = [None] + [{**top(rows[i]), text(t): float(rows[i, t])} for i, t in enumerate(ids) if i > 0]
        elif body.get("echo") and self.mode != "completion-only":
            tokens = [text(t) for t in ids] + tokens
            values = [None] + [float(rows[i - 1, t]) for i, t in enumerate(ids) if i > 0] + values
            tops = [None] + [top(rows[i - 1]) for i in range(1, len(ids))] + tops
        return {"object": "text_completion", "model": "fake", "choices": [{
            "index": 0, "text": text(g), "finish_reason": "length",
            "logprobs": {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                         "text_offset": [0] * len(tokens)}}]}

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode, fragments", [
    ("completion-only", ["are missing", "generated token only", "llama.cpp's C++ server"]),
    ("text-only", ["refuses token-id prompts", "shifted by one position",
                   "distribution that predicts token i+1", "llama-cpp-python"]),
])
def test_probe_refuses_untrustworthy_prompt_logprobs(tiny_models, files, mode, fragments):
    server = FakeServer(tiny_models["llama"], mode)
    try:
        code, err, out = run_cli("eval", str(tiny_models["llama"]), "--base-url", server.url, "--tasks", "ppl",
                                 "--text", str(files["text"]), "--ctx-size", "64")
    finally:
        server.stop()
    assert code == 2, (code, err, out)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err + out, err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_a_healthy_fake_server_passes_the_probe_and_scores_like_the_model(tiny_models, files):
    """The same fake, aligned: the probe passes and ppl equals the in-process figure (so the refusals
    above come from the defects, not from the fake)."""
    server = FakeServer(tiny_models["llama"], "aligned")
    try:
        code, remote, err = _eval(str(tiny_models["llama"]), "--base-url", server.url, "--tasks", "ppl",
                                  "--text", str(files["text"]), "--ctx-size", "64")
    finally:
        server.stop()
    assert code == 0, err
    code, local, err = _eval(str(tiny_models["llama"]), "--tasks", "ppl", "--text", str(files["text"]),
                             "--ctx-size", "64")
    assert code == 0, err
    assert math.isclose(remote["results"]["ppl"]["ppl,none"], local["results"]["ppl"]["ppl,none"], rel_tol=1e-4)


def _llama_cpp_runs() -> str | None:
    """Why llama-cpp-python's server cannot run here, or None."""
    try:
        import llama_cpp.server.app  # noqa: F401
    except ImportError as exc:
        return f"llama-cpp-python's server extras are not installed ({exc})"
    from llmopt.core.embedded import default_gguf_path

    # a prompt of several tokens: here llama.cpp's batched prefill is what crashes (SIGSEGV) where one token works
    code = ("import llama_cpp, sys; m = llama_cpp.Llama(sys.argv[1], n_ctx=256, verbose=False); "
            "m.create_completion('The library opens at nine in the morning and closes at six', max_tokens=1)")
    done = subprocess.run([sys.executable, "-c", code, str(default_gguf_path())], capture_output=True, timeout=300)
    return None if done.returncode == 0 else f"llama-cpp-python cannot decode on this machine (exit {done.returncode})"


@pytest.mark.integration
def test_probe_refuses_llama_cpp_pythons_server(tmp_path):
    """llama-cpp-python's own server (`--logits_all true`) on the embedded GGUF: refused with exit 2."""
    why = _llama_cpp_runs()
    if why:
        pytest.skip(why)
    from llmopt.bench.launch_server import launched_server
    from llmopt.core.embedded import default_gguf_path

    with launched_server("llama-cpp", str(default_gguf_path()), ["--n_ctx", "2048", "--logits_all", "true"]) as url:
        code, err, out = run_cli("eval", "default", "--base-url", url, "--tasks", "ppl", "--chunks", "1")
    assert code == 2, (code, err, out)
    assert "refuses token-id prompts" in err and "shifted by one position" in err and "Traceback" not in err, err


@pytest.mark.parametrize("args, fragments", [
    (["--base-url", "ftp://127.0.0.1:1", "--tasks", "ppl"], ["--base-url must start with http"]),
    (["--base-url", "http://127.0.0.1:1", "--tasks", "ppl"], ["tokenizer of the model it serves"]),
    (["{llama}", "--base-url", "http://127.0.0.1:1", "--tasks", "humaneval"], ["humaneval runs on a local model"]),
    (["{llama}", "--base-url", "http://127.0.0.1:1", "--tasks", "ppl", "--text", "{text}", "--ctx-size", "64"],
     ["cannot reach http://127.0.0.1:1/v1/models"]),
    (["{llama}", "--base-url", "http://127.0.0.1:1", "--tasks", "lm-eval:arc_easy"], ["runs on a local MODEL"]),
    (["--tasks", "ppl"], ["give MODEL"]),
    (["{llama}", "--baseline", "http://127.0.0.1:1/v1", "--tasks", "ppl"], ["--baseline is a local model"]),
])
def test_base_url_bad_input_is_one_line(tiny_models, files, args, fragments):
    from conftest import assert_usage_error

    args = [a.format(llama=tiny_models["llama"], text=files["text"]) for a in args]
    assert_usage_error(["eval", *args], *fragments)
