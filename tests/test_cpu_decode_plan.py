"""The C++ decode plan (all layers of a decode step in one call) against the module path:
the same tokens and bitwise the same log-probabilities, for fp32, int4 and FP8 weights, GQA,
sliding windows, biases and 16-bit KV caches."""

from __future__ import annotations

import pytest
import torch

from llmopt.kernels.cpu_extension import cpu_ops
from llmopt.quant.quantize import QuantizeRequest, quantize
from llmopt.runtime import SamplingParams
from llmopt.runtime.llm import LLM

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="the CPU kernels could not be built here")

PROMPTS = ["hello there", "a", "the rain in spain falls mainly", "1 2 3 4 5 6 7 8 9", "zzz", "once upon a time",
           "what is the capital of france?", "ok"]


@pytest.fixture(scope="module")
def int4_models(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("plan-int4")
    calib = root / "calib.txt"
    calib.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = {}
    for kind, kw in {"llama": dict(method="rtn"), "qwen2": dict(method="gptq", desc_act=True)}.items():
        out[kind] = root / kind
        quantize(QuantizeRequest(model=str(tiny_models[kind]), output=out[kind], group_size=32, calib=str(calib),
                                 num_samples=4, seq_len=32, seed=0, **kw))
    return out


def generate_both_ways(spec: str, prompts: list[str] = PROMPTS, **engine) -> tuple[list, list]:
    # no prefix caching: the second run would otherwise prefill only the prompts' last tokens
    llm = LLM(spec, max_num_seqs=16, enable_prefix_caching=False, **engine)
    runner = llm.engine.runner
    assert runner.decode_plan is not None and runner.decode_plan.num_layers() == llm.engine.loaded.config.num_hidden_layers
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True)
    with_plan = llm.generate(prompts, params)
    runner.decode_plan = None
    modules = llm.generate(prompts, params)
    return with_plan, modules


def assert_identical(a, b) -> None:
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].logprobs == y.outputs[0].logprobs  # exact floats: bitwise logits


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_fp32_plan_matches_modules(tiny_models, kind):
    assert_identical(*generate_both_ways(str(tiny_models[kind])))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_int4_plan_matches_modules(int4_models, kind):
    assert_identical(*generate_both_ways(str(int4_models[kind])))


def test_fp8_plan_matches_modules(tiny_models, tmp_path):
    out = tmp_path / "fp8"
    quantize(QuantizeRequest(model=str(tiny_models["llama"]), output=out, method="fp8"))
    assert_identical(*generate_both_ways(str(out)))


def test_bf16_kv_plan_matches_modules(tiny_models):
    assert_identical(*generate_both_ways(str(tiny_models["llama"]), kv_cache_dtype="bfloat16"))


@pytest.mark.parametrize("threads", [1, 3])
def test_plan_past_one_attention_chunk_on_any_team(tiny_models, threads):
    # contexts past one attention chunk (128 positions: the chunks' partial results are merged after a
    # barrier of the plan's team) beside short ones, and teams of other sizes than this machine's
    # threads (3 on 2 cores: the spin barriers must let a descheduled thread catch up)
    prompts = [" ".join(["word"] * 36), "short", " ".join(["x y"] * 30), "hello there"]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with_plan, modules = generate_both_ways(str(tiny_models["llama"]), prompts, kv_cache_dtype="float16")
    finally:
        torch.set_num_threads(before)
    assert len(with_plan[0].prompt_token_ids) > 140
    assert_identical(with_plan, modules)


@pytest.mark.parametrize("threads", [1, 3])
def test_int4_plan_prefetching_kv_ahead_matches_modules(int4_models, threads):
    # from 8 rows the int4 products prefetch the next layer's K/V rows (a thread's attention units,
    # chunked past 128 positions) as they compute: the same results on teams of any size
    prompts = [" ".join(["word"] * 40), "short", " ".join(["x y"] * 30), "hello there", "a b c", *PROMPTS[:4]]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with_plan, modules = generate_both_ways(str(int4_models["llama"]), prompts)
    finally:
        torch.set_num_threads(before)
    assert len(with_plan[0].prompt_token_ids) > 140
    assert_identical(with_plan, modules)


def test_no_plan_without_the_kernels(tiny_models, monkeypatch):
    import llmopt.runtime.model_runner as model_runner

    monkeypatch.setattr(model_runner, "build_decode_plan", lambda *a: None)
    llm = LLM(str(tiny_models["llama"]), max_num_seqs=2)
    assert llm.engine.runner.decode_plan is None
    assert len(llm.generate(["hi"], SamplingParams(max_tokens=3, temperature=0))[0].outputs[0].token_ids) == 3
