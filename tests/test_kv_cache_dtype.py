"""`kv_cache_dtype`: a bf16 (or fp16) KV pool under an fp32 model.

K/V are rounded into the pool when written and widened back when read, so every
attention path (C++ decode kernel, PyTorch decode and prefill) computes in fp32 on the
rounded values. The kernel vs the PyTorch path on the same 16-bit pool is checked in
test_cpu_paged_attention.py (rtol = atol = 1e-5: only summation order differs); here the
cost of the rounding itself is bounded, and the engine, config and CLI are checked.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_usage_error

from llmopt.errors import LlmoptError
from llmopt.kernels.cpu_paged_attention import decode_kernel
from llmopt.kernels.paged_attention import (
    attend,
    decode_mask,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_mask,
    write_kv,
)
from llmopt.runtime.config import EngineConfig, resolve_kv_cache_dtype

kernel = decode_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the CPU kernel could not be built here (no g++/ninja)")

# The kernel on a 16-bit pool vs exact fp32 attention on the unrounded K/V (random N(0, 1)
# K/V and q, contexts 1..300). Measured worst over 240 cases: bf16 max abs error 0.0104 (at
# |out| ~ 3: a 1-token context returns v itself, rounded to 2^-9 relative), relative
# Frobenius error 2.4e-3; fp16 0.0014 and 2.9e-4. Bounds below: about 2x / 4x of that.
ROUNDING_TOLERANCE = {
    torch.bfloat16: dict(atol=1e-2, rtol=1e-2, frobenius=5e-3),
    torch.float16: dict(atol=2e-3, rtol=2e-3, frobenius=1e-3),
}


def _pool(lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * width
    k = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen).view(len(lens), width)  # scattered blocks
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    return q, k, v, tables, torch.tensor(lens)


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 12])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_kernel_on_16bit_pool_close_to_fp32_pool(kv_dtype, heads, kv_heads, head_dim, sliding_window):
    block_size = 16
    q, k, v, tables, lens = _pool([1, 7, 33, 100, 300], heads, kv_heads, head_dim, block_size, seed=head_dim + heads)
    window = -1 if sliding_window is None else sliding_window
    exact = kernel(q, k, v, tables, lens, block_size, head_dim ** -0.5, window)
    got = kernel(q, k.to(kv_dtype), v.to(kv_dtype), tables, lens, block_size, head_dim ** -0.5, window)
    tol = ROUNDING_TOLERANCE[kv_dtype]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, exact, atol=tol["atol"], rtol=tol["rtol"])
    assert ((got - exact).norm() / exact.norm()).item() < tol["frobenius"]


def test_write_kv_rounds_into_the_pool():
    k_cache = torch.zeros(8, 2, 4, dtype=torch.bfloat16)
    v_cache = torch.zeros(8, 2, 4, dtype=torch.bfloat16)
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    slots = torch.tensor([5, 0, 2])
    write_kv(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache[slots], k.to(torch.bfloat16))
    assert torch.equal(v_cache[slots], v.to(torch.bfloat16))


def test_pytorch_paths_widen_a_bf16_pool_to_the_query_dtype():
    """Decode fallback and prefill: fp32 out, equal to fp32 attention over the widened pool."""
    q, k, v, tables, lens = _pool([3, 9, 20], 6, 2, 8, 4, seed=3)
    k16, v16 = k.to(torch.bfloat16), v.to(torch.bfloat16)
    mask = decode_mask(lens, tables.shape[1] * 4, None)
    out = paged_decode_attention(q, k16, v16, tables, mask)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, paged_decode_attention(q, k16.float(), v16.float(), tables, mask),
                               rtol=0, atol=0)

    slots = torch.tensor([7, 2, 11, 30, 31, 4])
    chunk = torch.randn(2, 6, 8)  # the last 2 of 6 tokens, after 4 cached ones
    out = paged_prefill_attention(chunk, k16, v16, slots, context_len=4, sliding_window=3)
    assert out.dtype == torch.float32
    expected = attend(chunk, k16[slots].float(), v16[slots].float(), prefill_mask(2, 4, 3, chunk.device))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_config_names_the_valid_values():
    assert EngineConfig().kv_cache_dtype == "auto"
    with pytest.raises(LlmoptError, match="auto, bfloat16, float16, float32, fp8"):
        EngineConfig(kv_cache_dtype="int8")
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) == resolve_kv_cache_dtype("fp8_e4m3", torch.float32) \
        == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("auto", torch.float32) == torch.float32
    assert resolve_kv_cache_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert resolve_kv_cache_dtype("float16", torch.bfloat16) == torch.float16
    with pytest.raises(LlmoptError, match="wider than the model's bfloat16.*auto, bfloat16, float16, fp8, fp8_e4m3$"):
        resolve_kv_cache_dtype("float32", torch.bfloat16)


@pytest.fixture(scope="module")
def tiny(tiny_models):
    from llmopt.loader import load

    return {kind: load(str(tiny_models[kind]), dtype="float32") for kind in ("llama", "mistral")}


@pytest.mark.parametrize("kind", ["llama", "mistral"])  # mistral: sliding window 8
def test_engine_bf16_pool_holds_twice_the_blocks_and_generates(tiny, kind):
    from llmopt.runtime import SamplingParams
    from llmopt.runtime.llm import LLM

    budget = 1 << 20
    fp32 = LLM(tiny[kind], kv_cache_memory=budget, block_size=4, max_model_len=128)
    bf16 = LLM(tiny[kind], kv_cache_memory=budget, block_size=4, max_model_len=128, kv_cache_dtype="bfloat16")
    assert fp32.engine.runner.attn.k_caches.dtype == torch.float32
    assert bf16.engine.runner.attn.k_caches.dtype == bf16.engine.runner.attn.v_caches.dtype == torch.bfloat16
    assert bf16.engine.kv.num_blocks == 2 * fp32.engine.kv.num_blocks
    assert bf16.engine.kv_cache_bytes <= budget
    if kernel is not None:
        assert bf16.engine.runner.attn.cpu_decode is kernel  # decodes read the bf16 pool in C++

    # long enough that decodes attend past mistral's window, and a prompt chunked over steps
    prompts = [[5, 17, 99, 3], list(range(3, 40)), [200, 13]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = {}
    for use_kernel in (True, False):
        llm = LLM(tiny[kind], num_kv_blocks=64, block_size=4, max_model_len=128, max_num_batched_tokens=16,
                  kv_cache_dtype="bfloat16")
        if not use_kernel:
            llm.engine.runner.attn.cpu_decode = None
        outputs[use_kernel] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert [len(ids) for ids in outputs[True]] == [24, 24, 24]
    assert outputs[True] == outputs[False]  # kernel and PyTorch path agree on the same bf16 pool


def test_fp8_pool_holds_four_times_the_blocks_and_scores_like_fp32(tiny):
    """fp8 (e4m3, scale 1) K/V under an fp32 model: a quarter of the bytes per block, and the
    prompt log-probabilities (the prefill reads back the chunk's own K/V from the pool) within
    e4m3's rounding of the fp32 pool's - but not equal to them: the pool really is fp8."""
    from llmopt.runtime import SamplingParams
    from llmopt.runtime.llm import LLM

    budget = 1 << 20
    fp32 = LLM(tiny["llama"], kv_cache_memory=budget, block_size=4, max_model_len=128)
    fp8 = LLM(tiny["llama"], kv_cache_memory=budget, block_size=4, max_model_len=128, kv_cache_dtype="fp8")
    assert fp8.engine.runner.attn.k_caches.dtype == torch.float8_e4m3fn
    assert 4 * fp32.engine.kv.num_blocks <= fp8.engine.kv.num_blocks < 4 * (fp32.engine.kv.num_blocks + 1)
    assert fp8.engine.runner.attn.cpu_decode is None and fp8.engine.runner.decode_plan is None  # PyTorch path
    prompts = [list(range(3, 60)), [5, 17, 99, 3, 42, 7, 120, 200, 13]]
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    scores = {}
    for name, llm in (("fp32", fp32), ("fp8", fp8)):
        outs = llm.generate(prompts, params)
        scores[name] = torch.tensor([next(iter(d.values())) for o in outs for d in o.prompt_logprobs[1:]])
    diff = (scores["fp8"] - scores["fp32"]).abs()
    assert 0 < diff.max().item() < 0.05, diff.max().item()  # measured: see the assertion message on failure


def test_engine_refuses_a_pool_wider_than_the_model(tiny_models):
    from llmopt.loader import load
    from llmopt.runtime.llm import LLM

    model = load(str(tiny_models["llama"]), dtype="bfloat16")
    with pytest.raises(LlmoptError, match="kv_cache_dtype float32 is wider"):
        LLM(model, num_kv_blocks=8, kv_cache_dtype="float32")
    llm = LLM(model, num_kv_blocks=8, block_size=4, max_model_len=64)  # auto: the model's bf16
    assert llm.engine.runner.attn.k_caches.dtype == torch.bfloat16
    assert llm.engine.runner.attn.cpu_decode is None  # the kernel takes fp32 queries only


@pytest.mark.parametrize("command", [["generate", "default", "-p", "hi"], ["serve", "default"], ["eval", "default"]])
def test_cli_bad_kv_cache_dtype_exits_2(command):
    assert_usage_error([*command, "--kv-cache-dtype", "int4"], "kv_cache_dtype 'int4'", "bfloat16")


def test_vllm_gets_the_flag_when_set(monkeypatch):
    from llmopt.runtime.engine_args import EngineArgs
    from llmopt.serve import launch

    monkeypatch.setattr(launch.shutil, "which", lambda name: "/usr/bin/vllm")
    assert "--kv-cache-dtype" not in launch.vllm_command(launch.ServeArgs("m", engine=EngineArgs(max_num_seqs=8)))
    argv = launch.vllm_command(launch.ServeArgs("m", engine=EngineArgs(max_num_seqs=8, kv_cache_dtype="fp8")))
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8"
