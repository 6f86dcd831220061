"""CUDA graphs for pure-decode steps (`llmopt/runtime/cuda_graphs.py`): buckets, flags, when a graph
runner is built, and the padded-bucket path against the eager one.

Without CUDA the padded path runs with the forward called on the persistent, padded inputs
instead of a replay (`GraphSettings(capture=False)`, put in through `cuda_graphs.graph_settings`):
the same buffers, padding rows and slicing a replay uses. Its logits must match the eager
path's within LOGPROB_TOL (fp32; only the batch's row count differs, which may change a
matmul's summation order); greedy tokens must be identical.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported

from llmopt.loader import load  # noqa: E402
from llmopt.runtime import EngineConfig, SamplingParams, cuda_graphs  # noqa: E402
from llmopt.runtime.cuda_graphs import GraphSettings, capture_batch_sizes, graph_settings  # noqa: E402
from llmopt.runtime.engine_args import EngineArgs  # noqa: E402
from llmopt.runtime.llm import LLM  # noqa: E402

LOGPROB_TOL = 1e-5  # nats, fp32 logprobs of the padded path vs eager (measured: 5e-7)
# prompts of different lengths, each with its own output length: the decode batch shrinks 5, 4, 3, 2, 1
# as they finish; the 30-token one passes MAX_CAPTURE at its third decode, so the two 4-sequence steps
# run eager
PROMPTS = [[(7 * i + 3 * j) % 200 + 3 for j in range(n)] for i, n in enumerate((5, 12, 30, 3, 20))]
MAX_TOKENS = (3, 9, 5, 12, 7)
MAX_CAPTURE = 32
ENGINE = dict(max_num_seqs=8, num_kv_blocks=32, block_size=8, enable_prefix_caching=False,
              max_seq_len_to_capture=MAX_CAPTURE)


def params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=3) for n in MAX_TOKENS]


def test_capture_batch_sizes_are_vllms_buckets():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(3) == [1, 2, 4]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert capture_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def test_flags_parse_and_reach_the_engine_config():
    import typer.main

    from llmopt.cli.main import app

    command = typer.main.get_command(app).commands["bench"].commands["latency"]
    ctx = command.make_context("llmopt bench latency", ["m", "--enforce-eager", "--max-seq-len-to-capture", "2048"])
    assert ctx.params["enforce_eager"] is True and ctx.params["max_seq_len_to_capture"] == 2048
    default = command.make_context("llmopt bench latency", ["m"]).params
    assert default["enforce_eager"] is False and default["max_seq_len_to_capture"] == 8192  # vLLM's defaults
    config = EngineArgs(enforce_eager=True, max_seq_len_to_capture=2048).engine_config()
    assert config.enforce_eager is True and config.max_seq_len_to_capture == 2048
    assert EngineConfig().enforce_eager is False and EngineConfig().max_seq_len_to_capture == 8192


def test_bad_max_seq_len_to_capture_is_a_usage_error(tiny_models):
    from conftest import assert_usage_error

    assert_usage_error(["generate", str(tiny_models["llama"]), "-p", "hi", "--max-seq-len-to-capture", "0"],
                       "max_seq_len_to_capture must be a positive integer")


def test_graphs_only_on_cuda_without_enforce_eager(tiny_models):
    cuda = torch.device("cuda")
    assert graph_settings(False, 8, 64, cuda) == GraphSettings(8, 64)
    assert graph_settings(True, 8, 64, cuda) is None  # --enforce-eager
    assert graph_settings(False, 8, 64, torch.device("cpu")) is None
    loaded = load(str(tiny_models["llama"]), dtype="float32", device="cpu")
    for eager in (False, True):
        runner = LLM(loaded, enforce_eager=eager, num_kv_blocks=16).engine.runner
        assert runner.graph_runner is None and runner.attn.k_caches.shape[1] == 16 * 16  # no scratch block


def test_serve_engine_vllm_gets_enforce_eager(monkeypatch):
    from llmopt.serve import launch

    monkeypatch.setattr(launch.shutil, "which", lambda name: "/usr/bin/vllm")
    assert "--enforce-eager" not in launch.vllm_command(launch.ServeArgs("m", engine=EngineArgs()))
    assert "--enforce-eager" in launch.vllm_command(launch.ServeArgs("m", engine=EngineArgs(enforce_eager=True)))


def _load(tiny_models, backend: str, monkeypatch, device: str = "cpu"):
    monkeypatch.setenv("LLMOPT_KERNELS", backend)
    loaded = load(str(tiny_models["llama"]), dtype="float32", device=device)
    monkeypatch.delenv("LLMOPT_KERNELS")
    return loaded


def _assert_same(got, want):
    for g, w in zip(got, want):
        g, w = g.outputs[0], w.outputs[0]
        assert g.token_ids == w.token_ids
        for lg, lw in zip(g.logprobs, w.logprobs):
            assert lg.keys() == lw.keys()
            diff = max(abs(lg[t].logprob - lw[t].logprob) if hasattr(lg[t], "logprob") else abs(lg[t] - lw[t])
                       for t in lw)
            assert diff <= LOGPROB_TOL, diff


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_padded_bucket_decode_equals_eager(tiny_models, monkeypatch, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    loaded = _load(tiny_models, backend, monkeypatch)
    want = LLM(loaded, **ENGINE).generate(PROMPTS, params())
    monkeypatch.setattr(cuda_graphs, "graph_settings",
                        lambda enforce_eager, max_num_seqs, max_len, device: GraphSettings(max_num_seqs, max_len,
                                                                                           capture=False))
    llm = LLM(loaded, **ENGINE)
    graphs = llm.engine.runner.graph_runner
    assert graphs is not None and graphs.batch_sizes == [1, 2, 4, 8] and graphs.scratch_block == 32
    batches = []
    run = graphs.run
    graphs.run = lambda ids, *a, **kw: batches.append(len(ids)) or run(ids, *a, **kw)
    got = llm.generate(PROMPTS, params())
    _assert_same(got, want)
    # bucket sizes (1, 2) and padded ones (3, 5) went through it; the steps past MAX_CAPTURE did not
    assert {1, 2, 3, 5} <= set(batches) and 4 not in batches, batches
    eager_steps = sum(MAX_TOKENS) - len(PROMPTS) - sum(batches)
    assert eager_steps > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (capture and replay)")
def test_cuda_graph_replay_equals_eager(tiny_models, monkeypatch):
    pytest.importorskip("triton")
    loaded = _load(tiny_models, "triton", monkeypatch, device="cuda")
    want = LLM(loaded, enforce_eager=True, **ENGINE).generate(PROMPTS, params())
    llm = LLM(loaded, **ENGINE)
    graphs = llm.engine.runner.graph_runner
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8]
    replays = []
    run = graphs.run
    graphs.run = lambda ids, *a, **kw: replays.append(len(ids)) or run(ids, *a, **kw)
    _assert_same(llm.generate(PROMPTS, params()), want)
    assert {1, 2, 3, 5} <= set(replays) and 4 not in replays, replays
