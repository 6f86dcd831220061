"""scripts/hf_baselines.py on a tiny random model: workload is deterministic, every request gets exactly
max_tokens tokens in both baselines, and greedy outputs agree between them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from hf_baselines import (  # noqa: E402
    BenchRequest,
    format_table,
    load_hf_model,
    make_chat_workload,
    run_hf_sequential,
    run_hf_static_batches,
)

from conftest import write_tiny_model  # noqa: E402
from llmopt.core.tokenizer import Tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("hfb") / "llama", "llama")
    return folder, Tokenizer.from_dir(folder), load_hf_model(folder)


def test_workload_deterministic(tiny):
    _, tok, _ = tiny
    a = make_chat_workload(tok.encode_chat, 12, 3, 9, seed=7, shared_system_prompt="Be brief.")
    b = make_chat_workload(tok.encode_chat, 12, 3, 9, seed=7, shared_system_prompt="Be brief.")
    c = make_chat_workload(tok.encode_chat, 12, 3, 9, seed=8)
    assert a == b and a != c
    assert all(3 <= r.max_tokens <= 9 for r in a)
    assert len({tuple(r.prompt_token_ids) for r in a}) > 6
    prefix = tok.encode_chat([{"role": "system", "content": "Be brief."}], add_generation_prompt=False)
    assert all(r.prompt_token_ids[:len(prefix)] == prefix for r in a)


def test_baselines_exact_lengths_and_agree(tiny):
    _, tok, model = tiny
    eos = tok.eos_token_ids[0]
    reqs = make_chat_workload(tok.encode_chat, 5, 2, 12, seed=1)
    # a short prompt too, so the static batch really left-pads
    reqs.append(BenchRequest(prompt_token_ids=reqs[0].prompt_token_ids[:5], max_tokens=7))
    # force EOS to be the greedy pick at every step: generation must still run the full max_tokens
    def boost_eos(module, args, logits):
        logits = logits.clone()
        logits[..., eos] += 1e4
        return logits

    hook = model.lm_head.register_forward_hook(boost_eos)
    try:
        seq = run_hf_sequential(model, reqs[:1], warmup=False, pad_token_id=eos)
    finally:
        hook.remove()
    assert seq.outputs[0] == [eos] * reqs[0].max_tokens
    assert len(seq.outputs[0]) == reqs[0].max_tokens

    seq = run_hf_sequential(model, reqs, pad_token_id=eos)
    static = run_hf_static_batches(model, reqs, batch_size=4, pad_token_id=eos)
    for r, a, b in zip(reqs, seq.outputs, static.outputs):
        assert len(a) == len(b) == r.max_tokens
    assert seq.outputs == static.outputs
    useful = sum(r.max_tokens for r in reqs)
    assert seq.output_tokens == static.output_tokens == useful
    steps = max(r.max_tokens for r in reqs[:4]) * 4 + max(r.max_tokens for r in reqs[4:]) * 2
    assert static.generated_tokens_computed == steps and static.num_batches == 2
    assert static.prompt_pad_tokens > 0
    assert "hf-static-batch4" in format_table([seq, static])
