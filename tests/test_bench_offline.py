"""`llmopt bench throughput` and `bench latency` on tiny random models: workloads, the engines'
exact lengths and agreement, the roofline's byte count, results files and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import assert_usage_error, run_cli, write_tiny_model
from llmopt.bench.datasets import BenchRequest, make_workload
from llmopt.bench.engines import EngineOptions, run_engine
from llmopt.bench.hf_baselines import load_hf_model, run_hf_sequential, run_hf_static_batches
from llmopt.bench.latency import LatencyConfig, run_latency
from llmopt.bench.roofline import decode_step_bytes, kv_bytes_per_token, weight_bytes_per_step
from llmopt.bench.throughput import ThroughputConfig, run_throughput
from llmopt.loader import load
from llmopt.core.tokenizer import Tokenizer
from llmopt.errors import LlmoptError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# nats: two fp32 paths (batched or not, padded or not, ours or transformers') differ by float rounding, ~1e-5
# in the logits; they are compared up to the reference's first top-2 gap below this. Tiny random models have
# gaps of a few thousandths, so the margin sits well above the rounding and well below typical gaps.
NEAR_TIE = 1e-3


def decisive_prefix(model, prompt: list[int], tokens: list[int]) -> int:
    """How many of `tokens` (the reference's greedy output) come before its first near tie."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    top = torch.log_softmax(logits.float(), -1).topk(2).values
    gaps = (top[:, 0] - top[:, 1]).tolist()
    return next((j for j, gap in enumerate(gaps) if gap < NEAR_TIE), len(gaps))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("bench") / "llama", "llama")
    return folder, Tokenizer.from_dir(folder)


def test_workloads_are_deterministic_and_sized(tiny):
    _, tok = tiny
    a = make_workload(tok, "chat", 12, output_len=10, range_ratio=0.5, seed=7)
    assert a == make_workload(tok, "chat", 12, output_len=10, range_ratio=0.5, seed=7)
    assert a != make_workload(tok, "chat", 12, output_len=10, range_ratio=0.5, seed=8)
    assert all(5 <= r.max_tokens <= 15 for r in a) and len({r.max_tokens for r in a}) > 1
    assert all(r.messages and r.prompt_token_ids == tok.encode(r.prompt, add_special_tokens=False) for r in a)
    shared = make_workload(tok, "prefix-shared", 4, output_len=4, prefix_len=200, seed=0)
    system = tok.encode_chat(shared[0].messages[:1], add_generation_prompt=False)
    assert len(system) >= 150 and all(r.prompt_token_ids[:len(system)] == system for r in shared)
    rand = make_workload(tok, "random", 5, input_len=20, output_len=3, seed=1)
    assert [len(r.prompt_token_ids) for r in rand] == [20] * 5 and all(r.max_tokens == 3 for r in rand)


def test_dataset_files(tiny, tmp_path):
    _, tok = tiny
    sharegpt = tmp_path / "sg.json"
    sharegpt.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "hi, how are you"}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},  # skipped: no reply
        {"conversations": [{"from": "human", "value": "bye"}, {"from": "gpt", "value": "see you"}]},
    ]))
    reqs = make_workload(tok, str(sharegpt), 10, output_len=None)
    assert [r.max_tokens for r in reqs] == [len(tok.encode("hi, how are you", add_special_tokens=False)),
                                           len(tok.encode("see you", add_special_tokens=False))]
    assert reqs[0].messages == [{"role": "user", "content": "hello there"}]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "abc", "output_len": 3}\n\n{"messages": [{"role": "user", "content": "x"}]}\n')
    reqs = make_workload(tok, str(jsonl), 1, output_len=None)
    assert reqs[0].prompt == "abc" and reqs[0].messages is None and reqs[0].max_tokens == 3
    with pytest.raises(LlmoptError, match="entry 2 gives no output length"):
        make_workload(tok, str(jsonl), 10, output_len=None)  # the second line has no output_len
    assert [r.max_tokens for r in make_workload(tok, str(jsonl), 10, output_len=5, range_ratio=0.0)] == [5, 5]
    with pytest.raises(LlmoptError, match="unknown dataset 'sharegpt'"):
        make_workload(tok, "sharegpt", 4)
    with pytest.raises(LlmoptError, match="range-ratio"):
        make_workload(tok, "chat", 4, range_ratio=1.5)


def test_hf_baselines_exact_lengths_and_agree(tiny):
    folder, tok = tiny
    model = load_hf_model(folder)
    eos = tok.eos_token_ids[0]
    reqs = make_workload(tok, "chat", 5, output_len=7, range_ratio=0.7, seed=1)
    reqs.append(BenchRequest(reqs[0].prompt_token_ids[:5], 7))  # a short prompt: the static batch left-pads

    def boost_eos(module, args, logits):  # EOS the greedy pick at every step: the run must still go on
        logits = logits.clone()
        logits[..., eos] += 1e4
        return logits

    hook = model.lm_head.register_forward_hook(boost_eos)
    try:
        seq = run_hf_sequential(model, reqs[:1], warmup=False, pad_token_id=eos)
    finally:
        hook.remove()
    assert seq.outputs[0] == [eos] * reqs[0].max_tokens

    seq = run_hf_sequential(model, reqs, pad_token_id=eos)
    static = run_hf_static_batches(model, reqs, batch_size=4, pad_token_id=eos)
    assert [len(o) for o in seq.outputs] == [r.max_tokens for r in reqs]
    assert [len(o) for o in static.outputs] == [r.max_tokens for r in reqs]
    # padded batches are another numeric path: tokens agree up to the reference's first near tie
    decisive = [decisive_prefix(model, r.prompt_token_ids, out) for r, out in zip(reqs, seq.outputs)]
    assert sum(decisive) >= sum(r.max_tokens for r in reqs) // 2
    for k, a, b in zip(decisive, seq.outputs, static.outputs):
        assert a[:k] == b[:k]
    steps = max(r.max_tokens for r in reqs[:4]) * 4 + max(r.max_tokens for r in reqs[4:]) * 2
    assert static.generated_tokens_computed == steps and static.num_batches == 2 and static.prompt_pad_tokens > 0


def test_engines_in_process_agree_with_transformers(tiny):
    folder, tok = tiny
    reqs = make_workload(tok, "chat", 6, output_len=6, range_ratio=0.5, seed=2)
    options = EngineOptions(engine_config={"max_num_seqs": 4, "kv_cache_memory": 1 << 24}, hf_batch_size=3,
                            hf_max_requests=3)
    ours = run_engine("llmopt", str(folder), reqs, options)
    hf = run_engine("hf", str(folder), reqs, options)
    batch = run_engine("hf-batch", str(folder), reqs, options)
    assert not (ours.skipped or hf.skipped or batch.skipped), (ours.skipped, hf.skipped, batch.skipped)
    assert ours.output_tokens == batch.output_tokens == sum(r.max_tokens for r in reqs)
    assert hf.num_requests == 3 and hf.output_tokens == sum(r.max_tokens for r in reqs[:3])
    # transformers and llmopt are two numeric paths: tokens agree up to the reference's first near tie
    model = load_hf_model(folder)
    decisive = [decisive_prefix(model, r.prompt_token_ids, out) for r, out in zip(reqs, batch.outputs)]
    assert sum(decisive) >= sum(r.max_tokens for r in reqs) // 2  # the comparison must cover most tokens
    for k, a, b in zip(decisive, ours.outputs, batch.outputs):
        assert a[:k] == b[:k]
    for k, a, b in zip(decisive, hf.outputs, batch.outputs):  # one at a time vs padded batches: two paths too
        assert a[:k] == b[:k]
    assert ours.mean_ttft_ms > 0 and ours.peak_kv_cache_gib > 0 and ours.label == "llmopt (float32)"
    missing = run_engine("vllm", str(folder), reqs, options)
    assert missing.skipped and "not installed" in missing.skipped or "vllm" in missing.skipped.lower()
    no_gguf = run_engine("llama.cpp", str(folder), reqs, options)
    assert no_gguf.skipped and ("--gguf" in no_gguf.skipped or "not installed" in no_gguf.skipped)


def test_throughput_runs_engines_in_their_own_processes(tiny):
    folder, _ = tiny
    config = ThroughputConfig(model=str(folder), engines=["llmopt", "hf-batch"], num_prompts=4, output_len=4,
                              range_ratio=0.0, options=EngineOptions(engine_config={"kv_cache_memory": 1 << 24},
                                                                     hf_batch_size=2))
    document = run_throughput(config)
    assert document["kind"] == "throughput" and document["metadata"]["torch"] == torch.__version__
    first, second = document["runs"]
    assert first["output_tokens"] == second["output_tokens"] == 16
    assert first["output_throughput_vs_first"] == 1.0
    same, common = second["same_tokens_as_first"]  # how many match depends on near ties (see the test above)
    assert common == 4 and 0 <= same <= 4
    assert second["output_throughput"] == pytest.approx(16 / second["elapsed_time"])
    assert document["config"]["workload"]["output_tokens"] == 16


def test_roofline_counts_what_a_step_reads(tiny):
    folder, _ = tiny
    loaded = load(str(folder))
    model = loaded.model
    cfg = loaded.config
    linear = sum(p.numel() for n, p in model.named_parameters() if "proj" in n) * 4
    head = cfg.vocab_size * cfg.hidden_size * 4  # tied embeddings: the head reads the embedding table
    norms = (2 * cfg.num_hidden_layers + 1) * cfg.hidden_size * 4
    assert weight_bytes_per_step(model) == linear + head + norms
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    assert kv_bytes_per_token(model, torch.bfloat16) == per_token
    assert decode_step_bytes(model, 3, 40, torch.bfloat16) == linear + head + norms + 3 * 40 * per_token
    # an int8 copy of the head is what a step then reads: a byte per weight plus an fp32 scale per 32, rows
    # padded to the kernel's tiles of 8
    assert model.lm_head.use_compact_copy("int8")
    rows = -(-cfg.vocab_size // 8) * 8
    int8_head = rows * cfg.hidden_size + rows * (cfg.hidden_size // 32) * 4
    assert weight_bytes_per_step(model) == linear + int8_head + norms


def test_latency_figures(tiny):
    folder, _ = tiny
    config = LatencyConfig(model=str(folder), batch_sizes=[1, 2], input_len=8, output_len=4, num_iters=2,
                           options=EngineOptions(engine_config={"kv_cache_memory": 1 << 24}))
    document = run_latency(config)
    runs = document["runs"]
    assert [r["batch_size"] for r in runs] == [1, 2]
    for run in runs:
        assert len(run["iterations"]) == 2
        assert run["tg_tok_s"] == pytest.approx(run["batch_size"] / (run["decode_step_ms"] / 1e3))
        assert run["pp_tok_s"] == pytest.approx(run["batch_size"] * 8 / (run["prefill_ms"] / 1e3))
        # against the higher of the bandwidth probes just before and after the row's measurement
        before, after = run["read_bandwidth_probes_gb_s"]
        assert run["read_bandwidth_gb_s"] == max(before, after) <= document["config"]["read_bandwidth_gb_s"]
        bandwidth = run["read_bandwidth_gb_s"] * 1e9
        assert run["ideal_tg_tok_s"] == pytest.approx(run["batch_size"] * bandwidth / run["decode_step_bytes"])
    assert runs[0]["read_bandwidth_probes_gb_s"][1] == runs[1]["read_bandwidth_probes_gb_s"][0]  # one probe between
    assert runs[1]["decode_step_bytes"] > runs[0]["decode_step_bytes"]  # one more sequence's K/V
    from llmopt.kernels.cpu_extension import cpu_isa

    assert all(run.get("cpu_kernels") == cpu_isa() for run in runs)  # None where the kernels are not built


def test_cli_throughput_writes_report(tiny, tmp_path):
    folder, _ = tiny
    out = tmp_path / "run"
    code, err, stdout = run_cli("bench", "throughput", str(folder), "--engines", "llmopt,vllm", "--num-prompts", "3",
                                "--output-len", "3", "--kv-cache-memory", "16MiB", "-o", str(out))
    assert code == 0, err
    assert "llmopt (float32)" in stdout and "skipped" in stdout
    document = json.loads((out / "results.json").read_text())
    assert [r["engine"] for r in document["runs"]] == ["llmopt", "vllm"]
    assert "| llmopt (float32) | 3 |" in (out / "report.md").read_text()
    assert (out / "throughput.png").read_bytes()[:8] == PNG_MAGIC


def test_cli_bad_input(tiny, tmp_path):
    folder, _ = tiny
    assert_usage_error(["bench", "throughput", str(folder), "--engines", "llmopt,tgi"], "unknown engine 'tgi'")
    assert_usage_error(["bench", "throughput", str(folder), "--dataset", "nope"], "unknown dataset 'nope'")
    assert_usage_error(["bench", "throughput", str(folder), "--output-len", "-3"], "lengths must be at least 1")
    assert_usage_error(["bench", "latency", str(folder), "--batch-size", "1,x"], "--batch-size")
    assert_usage_error(["bench", "latency", str(folder), "--engines", "hf"], "not 'hf'")
    assert_usage_error(["bench", "throughput", str(folder), "--hf-batch-size", "0"], "--hf-batch-size")
    assert_usage_error(["bench", "throughput", str(folder), "--dtype", "float8"], "unknown dtype 'float8'")
    assert_usage_error(["bench", "latency", str(folder), "--gguf", str(tmp_path / "none.gguf")], "--gguf")
    a_file = tmp_path / "taken"
    a_file.write_text("")
    assert_usage_error(["bench", "throughput", str(folder), "-o", str(a_file / "run")], "--output")
    assert not (tmp_path / "results.json").exists()
