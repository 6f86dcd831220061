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


# ---------------------------------------------------------------------------- checked before long work


@pytest.mark.parametrize("where", ["/dev/null/x", "/proc/llmopt-x"])
def test_unwritable_output_is_refused_before_any_work(tiny_models, monkeypatch, where):
    """`-o` into a place that cannot take a file used to fail only after the whole quantization."""
    from llmopt.quant import quantize as quantize_module

    if not Path(where).parent.is_dir() and not Path(where).parent.exists():
        pytest.skip(f"{Path(where).parent} is not on this machine")

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(quantize_module, "load", no_load)
    assert_usage_error(["quantize", str(tiny_models["llama"]), "-o", where, "--method", "awq"],
                       "cannot write", where)
    assert not Path(where).exists()


@pytest.mark.parametrize("change, fragment", [
    ({"hidden_size": "64"}, "hidden_size must be a positive integer, got '64'"),
    ({"intermediate_size": -128}, "intermediate_size must be a positive integer"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer, got 0"),
    ({"vocab_size": -5}, "vocab_size must be a positive integer, got -5"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be a positive integer, got True"),
    ({"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a positive number, got '1e-6'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "big"}}, "rope_theta must be a positive number"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false"),
    ({"eos_token_id": "end"}, "eos_token_id must be a token id"),
    ({"hidden_size": 66, "head_dim": None}, "hidden_size=66 is not a multiple of num_attention_heads=4"),
    ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": "2"}},
     "factor must be a positive number"),
    ({"rope_parameters": {"rope_type": "freq_factors", "rope_theta": 1e4, "freq_factors": [1.0, 2.0]}},
     "'freq_factors' needs head_dim / 2"),
])
def test_bad_config_values_are_one_line_exit_2(tiny_models, tmp_path, change, fragment):
    folder = copy_model(tiny_models["llama"], tmp_path / "m")
    config = read_config(folder)
    config.update(change)
    (folder / "config.json").write_text(json.dumps(config))
    assert_usage_error(["models", "info", str(folder)], "config.json", fragment)


def test_layer_count_beyond_the_checkpoint_is_refused_before_building(tiny_models, tmp_path):
    """num_hidden_layers 2**31 would build per-layer lists and modules of that length: refused from the
    config alone; a count within bounds but beyond the checkpoint's tensors, before the decoder is built."""
    folder = copy_model(tiny_models["llama"], tmp_path / "m")
    config = read_config(folder)
    config["num_hidden_layers"] = 2**31
    (folder / "config.json").write_text(json.dumps(config))
    assert_usage_error(["generate", str(folder), "-p", "hi", "--max-tokens", "1"], "num_hidden_layers must be at most")
    config["num_hidden_layers"] = 4000
    (folder / "config.json").write_text(json.dumps(config))
    assert_usage_error(["generate", str(folder), "-p", "hi", "--max-tokens", "1"], "num_hidden_layers=4000",
                       "3 layer(s)")


def _write_tiny_gguf(path: Path, block_count: int, head_count: int, blocks_held: int = 2) -> Path:
    """A small llama GGUF whose metadata says what the test wants, with the tensors of `blocks_held` blocks."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(block_count)
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(32)
    writer.add_head_count(head_count)
    writer.add_context_length(64)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(8)
    weights = {"token_embd.weight": (8, 16), "output_norm.weight": (16,)}
    for i in range(blocks_held):
        weights.update({f"blk.{i}.attn_q.weight": (16, 16), f"blk.{i}.attn_norm.weight": (16,)})
    for name, shape in weights.items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_block_count_beyond_the_file_is_refused_before_allocating(tmp_path):
    """block_count 2**31 used to build that many layers (18 GB RSS, killed by hand)."""
    bad = _write_tiny_gguf(tmp_path / "blocks.gguf", block_count=2**31, head_count=4)
    for args in (["models", "info", str(bad)], ["generate", str(bad), "-p", "hi", "--max-tokens", "1"]):
        assert_usage_error(args, "blocks.gguf", "block_count=2147483648", "2 block(s)")


def test_gguf_head_count_zero(tmp_path):
    bad = _write_tiny_gguf(tmp_path / "heads.gguf", block_count=2, head_count=0)
    assert_usage_error(["models", "info", str(bad)], "heads.gguf", "num_attention_heads must be a positive integer")


@pytest.mark.parametrize("count_offset, fragment", [(8, "not a readable GGUF file"), (16, "not a readable GGUF file")])
def test_gguf_counts_beyond_the_file_size(tmp_path, count_offset, fragment):
    """A tensor count (offset 8) or metadata count (offset 16) of 2**60 in a small file: a clear error, fast."""
    import struct
    import time

    good = _write_tiny_gguf(tmp_path / "good.gguf", block_count=2, head_count=4)
    data = bytearray(good.read_bytes())
    data[count_offset:count_offset + 8] = struct.pack("<Q", 2**60)
    bad = tmp_path / "counts.gguf"
    bad.write_bytes(bytes(data))
    start = time.perf_counter()
    assert_usage_error(["models", "info", str(bad)], "counts.gguf", fragment)
    assert time.perf_counter() - start < 30


def test_models_info_checks_safetensors_headers_and_offsets(tiny_models, tmp_path):
    """`models info` used to answer without opening the weights: a corrupt file now is exit 2."""
    import struct

    folder = copy_model(tiny_models["llama"], tmp_path / "m")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 4096  # a tensor whose bytes run past the end of the file
    text = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])
    assert_usage_error(["models", "info", str(folder)], "model.safetensors", "corrupt or truncated")
    weights.write_bytes(data[: len(data) - 100])  # truncated
    assert_usage_error(["models", "info", str(folder)], "model.safetensors", "corrupt or truncated")
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    assert_usage_error(["models", "info", str(folder)], "model.safetensors", "corrupt or truncated")


@pytest.mark.parametrize("text, fragment", [
    ("model: default\nx: " + "[" * 5000 + "]" * 5000 + "\n", "nests deeper than"),
    ("model: default\nx: " + "[" * 40 + "]" * 40 + "\n", "nests deeper than 32"),
    ("model: default\nquantize: {method: rtn, seed: " + "7" * 5000 + "}\n", "cannot be read"),
    ("model: default\na: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
     "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
     "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: [*e, *e, *e, *e, *e, *e, *e, *e, *e, *e]\n",
     "more than 100,000 values"),
])
def test_hostile_recipe_is_one_line_exit_2(tmp_path, text, fragment):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(text)
    assert_usage_error(["run", str(recipe), "-o", str(tmp_path / "out")], "bad.yaml", fragment)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value, fragment", [("7" * 5000, "cannot be read"), ("[" * 40 + "]" * 40, "nests deeper")])
def test_hostile_set_value_is_one_line_exit_2(tmp_path, value, fragment):
    recipe = tmp_path / "ok.yaml"
    recipe.write_text("model: default\n")
    assert_usage_error(["run", str(recipe), "-o", str(tmp_path / "out"), "--set", "quantize.seed=" + value],
                       "quantize.seed", fragment)
    assert not (tmp_path / "out").exists()


def test_a_bug_is_exit_3_never_the_gate_failed_code(tiny_models, monkeypatch):
    """Exit 1 means only "a quality gate failed": an unexpected exception (a bug) is exit 3, with its traceback."""
    from llmopt.cli import models as models_cli

    def broken(source):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(models_cli, "describe", broken)
    code, err, _ = run_cli("models", "info", str(tiny_models["llama"]))
    assert code == 3, err
    assert "Traceback" in err and "internal error" in err and "ZeroDivisionError" in err
