"""Bad input: one clear line on stderr, exit code 2, no traceback, nothing half-written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_usage_error, read_config, run_cli

def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_unknown_spec():
    assert_usage_error(["models", "info", "no-such-model"], "unknown model spec 'no-such-model'", "default")


def test_missing_folder(tmp_path):
    missing = tmp_path / "nowhere"
    assert_usage_error(["generate", str(missing) + "/", "-p", "hi"], str(missing), "does not exist")


def test_missing_gguf_file(tmp_path):
    assert_usage_error(["models", "info", str(tmp_path / "x.gguf")], "does not exist")


def test_folder_without_config(tmp_path):
    assert_usage_error(["models", "info", str(tmp_path)], "has no config.json")


def test_corrupt_safetensors(tiny_models, tmp_path):
    folder = copy_model(tiny_models["llama"], tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    assert_usage_error(["generate", str(folder), "-p", "hi"], "model.safetensors", "corrupt or truncated")


def test_truncated_safetensors(tiny_models, tmp_path):
    folder = copy_model(tiny_models["llama"], tmp_path / "m")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    assert_usage_error(["generate", str(folder), "-p", "hi"], "model.safetensors", "corrupt or truncated")


def test_missing_tensor(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = copy_model(tiny_models["llama"], tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    assert_usage_error(["generate", str(folder), "-p", "hi"], "missing tensor", "model.layers.1.mlp.up_proj.weight")


def test_unsupported_architecture(tiny_models, tmp_path):
    folder = copy_model(tiny_models["llama"], tmp_path / "m")
    config = read_config(folder)
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(config))
    line = assert_usage_error(["models", "info", str(folder)], "unsupported architecture GPT2LMHeadModel")
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert supported in line


def test_config_missing_keys(tiny_models, tmp_path):
    folder = copy_model(tiny_models["llama"], tmp_path / "m")
    config = read_config(folder)
    del config["hidden_size"], config["num_hidden_layers"]
    (folder / "config.json").write_text(json.dumps(config))
    assert_usage_error(["models", "info", str(folder)], "missing required key(s)", "hidden_size", "num_hidden_layers")


def test_config_not_json(tiny_models, tmp_path):
    folder = copy_model(tiny_models["llama"], tmp_path / "m")
    (folder / "config.json").write_text("{not json")
    assert_usage_error(["models", "info", str(folder)], "not valid JSON")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 64)
    assert_usage_error(["models", "info", str(bad)], "bad.gguf", "not a readable GGUF file")


def test_truncated_gguf(tmp_path):
    from llmopt.core.embedded import default_gguf_path

    data = default_gguf_path().read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 3])
    assert_usage_error(["models", "info", str(cut)], "cut.gguf", "truncated")


def test_hub_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert_usage_error(["models", "info", "nobody-here/not-a-model"], "nobody-here/not-a-model", "HF_HUB_OFFLINE")


def test_quantized_config_without_packed_tensors(tiny_models, tmp_path):
    folder = copy_model(tiny_models["llama"], tmp_path / "m")
    config = read_config(folder)
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                     "version": "gemm"}
    (folder / "config.json").write_text(json.dumps(config))
    code, _, out = run_cli("models", "info", str(folder), "--json")
    assert code == 0
    assert json.loads(out)["quantization"]["method"] == "awq"
    assert_usage_error(["generate", str(folder), "-p", "hi"], "config says AWQ", "no packed (.qweight) tensors")


def test_corrupt_packed_tensors(tiny_models, tmp_path):
    from llmopt.core.weights import load_safetensors, save_safetensors

    folder = tmp_path / "gptq"
    code, err, _ = run_cli("quantize", str(tiny_models["llama"]), "-o", str(folder), "--method", "rtn", "--group-size", "32")
    assert code == 0, err
    tensors = load_safetensors([folder / "model.safetensors"])
    tensors["model.layers.1.mlp.up_proj.scales"] = tensors["model.layers.1.mlp.up_proj.scales"][:1].clone()
    save_safetensors(tensors, folder / "model.safetensors")
    assert_usage_error(["generate", str(folder), "-p", "hi"], "model.layers.1.mlp.up_proj", "do not match")


def test_unknown_quantization_method(tiny_models, tmp_path):
    folder = copy_model(tiny_models["llama"], tmp_path / "m")
    config = read_config(folder)
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    (folder / "config.json").write_text(json.dumps(config))
    assert_usage_error(["models", "info", str(folder)], "'bitsandbytes' is not supported", "awq, gptq")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--max-tokens", "0"], "max_tokens must be a positive integer"),
        (["--dtype", "int3"], "unknown dtype 'int3'"),
    ],
)
def test_bad_generate_options(tiny_models, args, fragment):
    assert_usage_error(["generate", str(tiny_models["llama"]), "-p", "hi", *args], fragment)


def test_empty_prompt(tiny_models):
    assert_usage_error(["generate", str(tiny_models["llama"]), "-p", "  "], "--prompt is empty")


def test_convert_refuses_existing_output(tiny_models, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert_usage_error(["models", "convert", str(tiny_models["llama"]), "-o", str(out)], "already exists", "--force")


def test_real_process_exit_code_and_debug_flag():
    """The installed entry point, not just the test runner: exit 2, one line; --debug adds the traceback."""
    plain = subprocess.run([sys.executable, "-m", "llmopt", "models", "info", "nope"], capture_output=True, text=True)
    assert plain.returncode == 2 and plain.stderr.strip().startswith("error: unknown model spec")
    assert "Traceback" not in plain.stderr
    debug = subprocess.run([sys.executable, "-m", "llmopt", "--debug", "models", "info", "nope"],
                           capture_output=True, text=True)
    assert debug.returncode == 2 and "Traceback" in debug.stderr


def test_prompts_file_with_one_bad_prompt(tiny_models, tmp_path):
    """The good prompts still run and print; the bad one is reported; exit code 2."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "the cat"}) + "\n" + json.dumps({"prompt": "x" * 400}) + "\n"
                       + json.dumps("in the beginning") + "\n")
    code, err, out = run_cli("generate", str(tiny_models["llama"]), "-f", str(prompts), "--no-chat",
                             "--max-model-len", "128", "--kv-cache-memory", "16MiB", "--max-tokens", "5",
                             "--temperature", "0", "--ignore-eos", "--json")
    assert code == 2
    doc = json.loads(out)
    assert doc["num_requests"] == 3 and doc["num_failed"] == 1
    assert [r["num_generated_tokens"] for r in doc["requests"]] == [5, 0, 5]
    assert "max_model_len" in doc["requests"][1]["error"]
    assert "error: prompt 1:" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "content, fragment",
    [("{not json}\n", "p.jsonl:1: not valid JSON"), (json.dumps({"text": "hi"}) + "\n", "p.jsonl:1: expected")],
)
def test_malformed_prompts_file(tiny_models, tmp_path, content, fragment):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(content)
    assert_usage_error(["generate", str(tiny_models["llama"]), "-f", str(prompts)], fragment)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--kv-cache-memory", "lots"], "cannot read 'lots' as a size"),
        (["--max-num-seqs", "0"], "max_num_seqs must be a positive integer"),
        (["--block-size", "-4"], "block_size must be a positive integer"),
        (["--max-model-len", "100000"], "exceeds the model's context"),
        (["--stop", ""], "stop strings must not be empty"),
    ],
)
def test_bad_engine_options(tiny_models, args, fragment):
    assert_usage_error(["generate", str(tiny_models["llama"]), "-p", "hi", *args], fragment)


@pytest.mark.parametrize(
    "args, fragment",
    [(["--engine", "tgi"], "unknown engine 'tgi'"), (["--port", "70000"], "--port must be 1-65535"),
     (["--max-queue", "0"], "--max-queue must be positive"),
     (["--max-prompts-per-request", "0"], "--max-prompts-per-request must be positive"),
     (["--read-timeout", "0"], "--read-timeout must be positive"),
     (["--prepare-timeout", "nan"], "--prepare-timeout must be positive"),
     (["--engine", "llama.cpp"], "runs .gguf files")],
)
def test_bad_serve_options(tiny_models, args, fragment):
    assert_usage_error(["serve", str(tiny_models["llama"]), *args], fragment)


def test_generate_engine_flag(tiny_models):
    assert_usage_error(["generate", str(tiny_models["llama"]), "-p", "hi", "--engine", "tgi"], "unknown engine", "llama.cpp")
    assert_usage_error(["generate", str(tiny_models["llama"]), "-p", "hi", "--engine", "llama.cpp"], ".gguf")
