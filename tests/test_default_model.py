"""Integration tests on the embedded default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from llmopt.core import resolve
from llmopt.loader import load
from llmopt.runtime import SamplingParams
from llmopt.runtime.llm import LLM

pytestmark = pytest.mark.integration

MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List three colours. ünïcödé 123 ✓"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


@pytest.fixture(scope="module")
def loaded():
    return load("default", dtype="float32")


@pytest.fixture(scope="module")
def hf(loaded):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = loaded.source.path
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(folder)


def test_architecture_of_default():
    cfg = resolve("default").config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings


def test_models_info_json_cli():
    out = subprocess.run([sys.executable, "-m", "llmopt", "models", "info", "default", "--json"],
                         capture_output=True, text=True, check=True, env=os.environ.copy())
    arch = json.loads(out.stdout)["architecture"]
    assert arch["num_hidden_layers"] == 30 and arch["hidden_size"] == 576
    assert arch["num_attention_heads"] == 9 and arch["num_key_value_heads"] == 3
    assert arch["vocab_size"] == 49152 and arch["tie_word_embeddings"] is True


def test_chat_template_matches_transformers(loaded, hf):
    _, hf_tok = hf
    for messages in MESSAGES:
        expected = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(expected, dict) or hasattr(expected, "input_ids"):
            expected = expected["input_ids"]
        assert loaded.tokenizer.encode_chat(messages) == list(expected)


def test_logits_match_transformers(loaded, hf):
    """Our fp32 logits within 1e-4 of transformers' on the same weights.

    The reference is transformers run in float64: our decode-size matmuls (the C++ skinny
    kernel, `llmopt.kernels.cpu_linear`) round differently from MKL's, and measured against
    float64 they are the more accurate of the two (max |diff| 5.1e-5 vs transformers fp32's
    9.3e-5 on these prompts), so ours vs transformers fp32 can reach ~1.1e-4 without either
    being wrong. The test asserts both: within 1e-4 of the float64 reference, and no further
    from it than transformers' own fp32 logits (plus a sliver for ties in rounding).
    """
    model, _ = hf
    from transformers import AutoModelForCausalLM

    from llmopt.model.attention import ContiguousKVCache

    model64 = AutoModelForCausalLM.from_pretrained(loaded.source.path, dtype=torch.float64).eval()
    cfg = loaded.config
    for messages in MESSAGES:
        ids = loaded.tokenizer.encode_chat(messages)
        cache = ContiguousKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, len(ids))
        cache.begin_step([0], [len(ids)])
        ours = loaded.model.compute_logits(loaded.model(torch.tensor(ids), torch.arange(len(ids)), cache)).double()
        with torch.no_grad():
            ref64 = model64(torch.tensor([ids])).logits[0]
            ref32 = model(torch.tensor([ids])).logits[0].double()
        ours_err, theirs_err = (ours - ref64).abs().max().item(), (ref32 - ref64).abs().max().item()
        assert ours_err < 1e-4, f"max |ours - transformers fp64| = {ours_err}"
        assert ours_err <= theirs_err * 1.1, f"ours {ours_err} vs transformers fp32's own error {theirs_err}"
        assert (ours - ref32).abs().max().item() < 2.5e-4  # the two fp32 computations, for scale


def test_greedy_32_tokens_match_transformers(loaded, hf):
    model, _ = hf
    llm = LLM(loaded, num_kv_blocks=256)
    for messages in MESSAGES:
        ids = loaded.tokenizer.encode_chat(messages)
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        ours = llm.generate([ids], params)[0].outputs[0].token_ids
        with torch.no_grad():
            # neither side stops at EOS, so all 32 positions are compared
            model.generation_config.eos_token_id = None
            model.generation_config.pad_token_id = 2
            # an explicit mask: otherwise generate() masks prompt tokens equal to pad (<|im_end|>)
            ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=32, do_sample=False)
        assert ours == ref[0, len(ids):].tolist()


def test_generate_cli_answers_paris():
    out = subprocess.run(
        [sys.executable, "-m", "llmopt", "generate", "default", "--prompt", "What is the capital of France?",
         "--max-tokens", "16", "--temperature", "0"],
        capture_output=True, text=True, check=True, env=os.environ.copy(),
    )
    assert "Paris" in out.stdout


def test_generate_cli_json_and_seeded_sampling():
    cmd = [sys.executable, "-m", "llmopt", "generate", "default", "-p", "Tell me a story.", "--max-tokens", "12",
           "--temperature", "1.0", "--seed", "7", "--json"]
    first = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    second = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    a, b = first["requests"][0], second["requests"][0]
    assert a["token_ids"] == b["token_ids"]
    assert a["num_generated_tokens"] == len(a["token_ids"]) <= 12
    assert first["output_tokens_per_s"] > 0 and a["text"]
    assert a["metrics"]["time_to_first_token_s"] > 0
