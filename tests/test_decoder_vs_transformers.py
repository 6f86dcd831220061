"""Our decoder against transformers on the same weights: logits within 1e-4, greedy identical."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_CONFIGS
from llmopt.loader import load
from llmopt.model.attention import ContiguousKVCache
from llmopt.runtime import SamplingParams
from llmopt.runtime.llm import LLM

PROMPTS = [
    [5, 17, 99, 3, 42],
    [7] * 3 + list(range(20, 41)),  # longer than mistral's sliding window of 8
    [120],
    list(range(200, 213)),
]


def hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def our_packed_logits(loaded, prompts, chunk: int | None = None):
    """Run all prompts packed into flat batches; optionally in chunks of `chunk` tokens each."""
    cfg = loaded.config
    cache = ContiguousKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                              max(map(len, prompts)), num_slots=len(prompts))
    outs = [[] for _ in prompts]
    done = [0] * len(prompts)
    while any(d < len(p) for d, p in zip(done, prompts)):
        slots, lens, ids, pos = [], [], [], []
        for i, p in enumerate(prompts):
            n = min(chunk or len(p), len(p) - done[i])
            if n == 0:
                continue
            slots.append(i), lens.append(n)
            ids += p[done[i]:done[i] + n]
            pos += list(range(done[i], done[i] + n))
        cache.begin_step(slots, lens)
        hidden = loaded.model(torch.tensor(ids), torch.tensor(pos), cache)
        cache.end_step()
        logits = loaded.model.compute_logits(hidden)
        start = 0
        for i, n in zip(slots, lens):
            outs[i].append(logits[start:start + n])
            done[i] += n
            start += n
    return [torch.cat(o) for o in outs]


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
@pytest.mark.parametrize("chunk", [None, 4])
def test_logits_match_transformers(tiny_models, kind, chunk):
    folder = tiny_models[kind]
    ours = load(str(folder), dtype="float32")
    ref = hf_model(folder)
    got = our_packed_logits(ours, PROMPTS, chunk=chunk)
    for prompt, logits in zip(PROMPTS, got):
        with torch.no_grad():
            expected = ref(torch.tensor([prompt])).logits[0]
        assert logits.shape == expected.shape
        diff = (logits - expected).abs().max().item()
        assert diff < 1e-4, f"{kind}: max |diff| {diff} for prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("kind", list(TINY_CONFIGS))
def test_greedy_generation_matches_transformers(tiny_models, kind):
    folder = tiny_models[kind]
    ours = load(str(folder), dtype="float32")
    ref = hf_model(folder)
    ref.generation_config.eos_token_id = None
    ref.generation_config.pad_token_id = 0
    llm = LLM(ours, num_kv_blocks=64)
    for prompt in PROMPTS[:3]:
        result = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].outputs[0]
        with torch.no_grad():
            expected = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    max_new_tokens=32, do_sample=False)[0, len(prompt):]
        assert result.token_ids == expected.tolist(), kind
        assert result.finish_reason == "length"


def test_sliding_window_changes_attention(tiny_models):
    """Mistral's window must matter: the same weights without it give different logits."""
    from llmopt.core import resolve
    from llmopt.loader import build_model
    from llmopt.core.weights import load_safetensors, safetensors_files

    source = resolve(str(tiny_models["mistral"]))
    assert source.config.sliding_windows == [8, 8, 8]
    windowed = load(source, dtype="float32")
    source.config.sliding_windows = [None, None, None]
    full = build_model(source.config, load_safetensors(safetensors_files(source.path)), torch.float32, torch.device("cpu"))
    prompt = PROMPTS[1]
    a = our_packed_logits(windowed, [prompt])[0]
    b = our_packed_logits(type(windowed)(**{**windowed.__dict__, "model": full}), [prompt])[0]
    assert (a[:8] - b[:8]).abs().max() < 1e-5  # inside the window: identical
    assert (a[8:] - b[8:]).abs().max() > 1e-3  # beyond it: different
