"""Speculative decoding from the command line: the flags in generate/serve/bench, --json stats, a
mismatched draft refused with exit 2, and vLLM's spec_decode counters on /metrics after a served
request."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from conftest import assert_usage_error, run_cli, write_tiny_model
from test_engine_args import COMMANDS

from llmopt.runtime.engine_args import EngineArgs
from llmopt.loader import load
from llmopt.runtime import LLM, SamplingParams

SPEC_FLAGS = ["--speculative-model", "--speculative-method", "--num-speculative-tokens", "--prompt-lookup-min",
              "--prompt-lookup-max", "--speculative-disable-by-batch-size", "--speculative-allow-mismatch"]


@pytest.mark.parametrize("command", [c for c, _ in COMMANDS], ids=[" ".join(c) for c, _ in COMMANDS])
def test_every_engine_command_takes_the_speculative_flags(command):
    import typer

    from llmopt.cli.main import app

    click_command = typer.main.get_command(app)
    for name in command:
        click_command = click_command.commands[name]  # type: ignore[attr-defined]
    options = {opt for param in click_command.params for opt in param.opts}
    assert [f for f in SPEC_FLAGS if f not in options] == []


def test_flags_build_vllms_speculative_config():
    assert EngineArgs().engine_config().speculative_config is None
    spec = EngineArgs(speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_max=4,
                      speculative_disable_by_batch_size=8).engine_config().speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
            spec.disable_by_batch_size) == ("ngram", 3, 2, 4, 8)
    spec = EngineArgs(speculative_model="draft", speculative_allow_mismatch=True).engine_config().speculative_config
    assert (spec.method, spec.model, spec.allow_mismatch) == ("draft_model", "draft", True)


def test_vllm_gets_its_speculative_config(monkeypatch):
    from llmopt.serve import launch

    monkeypatch.setattr(launch.shutil, "which", lambda name: "/usr/bin/vllm")
    argv = launch.vllm_command(launch.ServeArgs("m", engine=EngineArgs(speculative_method="ngram",
                                                                       num_speculative_tokens=5)))
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {"method": "ngram",
                                                                       "num_speculative_tokens": 5}


def test_bad_speculative_flags_exit_2(tiny_models, tmp_path):
    model = str(tiny_models["llama"])
    assert_usage_error(["generate", model, "-p", "hi", "--num-speculative-tokens", "3"],
                       "--num-speculative-tokens: speculative decoding needs --speculative-model")
    assert_usage_error(["generate", model, "-p", "hi", "--speculative-method", "eagle"], "speculative method must be")
    assert_usage_error(["generate", model, "-p", "hi", "--speculative-method", "ngram", "--prompt-lookup-min", "4",
                        "--prompt-lookup-max", "2"], "prompt_lookup_min <= prompt_lookup_max")
    # a draft whose token ids mean other tokens: refused at start-up, naming the first differing id
    draft = write_tiny_model(tmp_path / "other-vocab", "llama")
    data = json.loads((draft / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (draft / "tokenizer.json").write_text(json.dumps(data))
    assert_usage_error(["generate", model, "-p", "hi", "--speculative-model", str(draft)],
                       "token id 0 is")


def test_generate_json_reports_speculation(tiny_models):
    model = str(tiny_models["llama"])
    common = ["generate", model, "-p", "the cat sat on the mat and the cat sat on", "--max-tokens", "24",
              "--temperature", "0", "--ignore-eos", "--json", "--dtype", "float32", "--kv-cache-memory", "16MiB"]
    code, err, out = run_cli(*common)
    assert code == 0, err
    plain = json.loads(out)
    code, err, out = run_cli(*common, "--speculative-model", model, "--num-speculative-tokens", "3")
    assert code == 0, err
    spec = json.loads(out)
    assert spec["requests"][0]["token_ids"] == plain["requests"][0]["token_ids"]
    stats = spec["engine"]["spec_decode"]
    # the target as its own draft: every proposal accepted, each request's counters add up to the engine's
    assert stats["num_drafts"] > 0 and stats["num_accepted_tokens"] == stats["num_draft_tokens"]
    assert stats["mean_acceptance_length"] == round(1 + stats["num_accepted_tokens"] / stats["num_drafts"], 4) > 3
    metrics = spec["requests"][0]["metrics"]
    assert metrics["spec_num_accepted_tokens"] == stats["num_accepted_tokens"]
    assert plain["engine"]["spec_decode"] is None


def test_metrics_show_spec_decode_counters_after_a_served_request(tiny_models):
    from test_serve import start_server

    model = str(tiny_models["llama"])
    proc, base = start_server(model, "--served-model-name", "tiny", "--kv-cache-memory", "32MiB",
                              "--max-model-len", "256", "--speculative-model", model, "--num-speculative-tokens", "3")
    try:
        body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
        metrics = httpx.get(base + "/metrics").text
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    expected = LLM(load(model, dtype="float32"), num_kv_blocks=64).generate(
        [[5, 6, 7, 8]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].outputs[0].text
    assert answer["choices"][0]["text"] == expected

    def value(name: str, labels: str = "") -> float:
        found = re.search(rf'^llmopt:{name}{{model_name="tiny"{labels}}} (\S+)$', metrics, re.M)
        assert found, f"llmopt:{name} missing from /metrics"
        return float(found.group(1))

    drafts = value("spec_decode_num_drafts_total")
    draft_tokens = value("spec_decode_num_draft_tokens_total")
    assert drafts > 0 and drafts * 2 < draft_tokens <= 3 * drafts  # proposals shorten near max_tokens
    accepted = value("spec_decode_num_accepted_tokens_total")
    assert accepted == draft_tokens  # self-draft, greedy: all accepted
    per_pos = [value("spec_decode_num_accepted_tokens_per_pos_total", f',position="{p}"') for p in range(3)]
    assert sum(per_pos) == accepted
    assert value("spec_decode_rolling_accepted_tokens_per_draft") == pytest.approx(accepted / drafts)
    assert value("spec_decode_disabled_by_batch_size") == 0.0
