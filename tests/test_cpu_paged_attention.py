"""The C++ CPU decode kernel against the pure-PyTorch paged attention it replaces.

Both read the same pool, fp32 or 16-bit (bf16/fp16 K/V, fp32 queries): they see the same
values and differ only in summation order, hence one tolerance for every pool dtype.
"""

from __future__ import annotations

import pytest
import torch

from llmopt.kernels.cpu_paged_attention import decode_kernel
from llmopt.kernels.paged_attention import decode_mask, paged_decode_attention

kernel = decode_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="the CPU kernel could not be built here (no g++/ninja)")


def _case(lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int, seed: int,
          kv_dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * width + 3
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen)  # blocks scattered through the pool
    tables = []
    for i, n in enumerate(lens):
        used = order[i * width: i * width + -(-n // block_size)].tolist()
        tables.append(used + [used[0]] * (width - len(used)))
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    return q, k_cache.to(kv_dtype), v_cache.to(kv_dtype), torch.tensor(tables), torch.tensor(lens)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("head_dim", [64, 72, 12])  # 12: not a multiple of 8, the kernel's scalar path
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_pytorch_path(heads, kv_heads, sliding_window, head_dim, kv_dtype):
    lens = [1, 4, 5, 17, 33, 64, 2, 8, 16]
    block_size = 4
    q, k_cache, v_cache, tables, context = _case(lens, heads, kv_heads, head_dim, block_size, seed=heads + kv_heads,
                                                 kv_dtype=kv_dtype)
    mask = decode_mask(context, tables.shape[1] * block_size, sliding_window)
    expected = paged_decode_attention(q, k_cache, v_cache, tables, mask)
    got = kernel(q, k_cache, v_cache, tables, context, block_size, head_dim ** -0.5,
                 -1 if sliding_window is None else sliding_window)
    assert got.shape == expected.shape and got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1)])
@pytest.mark.parametrize("sliding_window", [None, 200])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_long_contexts_split_into_chunks_match(heads, kv_heads, sliding_window, kv_dtype):
    """Contexts over the kernel's 128-position chunk: the chunks' partial softmaxes merged."""
    lens = [700, 129, 128, 257, 3, 384]
    block_size = 16
    q, k_cache, v_cache, tables, context = _case(lens, heads, kv_heads, 64, block_size, seed=7, kv_dtype=kv_dtype)
    q = q * 4  # peaked attention: the merge's rescaling by each chunk's max matters
    mask = decode_mask(context, tables.shape[1] * block_size, sliding_window)
    expected = paged_decode_attention(q, k_cache, v_cache, tables, mask)
    got = kernel(q, k_cache, v_cache, tables, context, block_size, 64 ** -0.5,
                 -1 if sliding_window is None else sliding_window)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # a sequence's output does not depend on the batch around it
    alone = kernel(q[:1], k_cache, v_cache, tables[:1], context[:1], block_size, 64 ** -0.5,
                   -1 if sliding_window is None else sliding_window)
    assert torch.equal(alone, got[:1])


def _avx512_path_available() -> bool:
    from llmopt.kernels.cpu_extension import cpu_ops

    ops = cpu_ops()
    return ops is not None and ops.cpu_isa_supported() in ("avx512", "amx")


@pytest.mark.skipif(not _avx512_path_available(),
                    reason="the AVX-512 path needs AVX-512 F/BW/VL/VNNI (this CPU or build lacks them)")
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (32, 8), (8, 1), (12, 2), (7, 7)])  # groups of 3, 4, 8, 6, 1
@pytest.mark.parametrize("head_dim", [64, 128, 80, 16])  # 80: a last block of one 16-float piece
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_avx512_path_is_bitwise_the_avx2_one(heads, kv_heads, head_dim, kv_dtype):
    """Rows loaded once for several query heads take the same sums in the same order: the same bits,
    across chunked contexts, key tails (lengths not a multiple of 8) and sliding windows."""
    from llmopt.kernels.cpu_extension import cpu_ops

    ops = cpu_ops()
    lens = [1, 7, 9, 130, 300, 64]
    q, k_cache, v_cache, tables, context = _case(lens, heads, kv_heads, head_dim, 16, seed=heads * head_dim,
                                                 kv_dtype=kv_dtype)
    q = q * 3
    for window in (-1, 100):
        previous = ops.set_cpu_isa("avx2")
        try:
            narrow = ops.paged_decode(q, k_cache, v_cache, tables, context, 16, head_dim ** -0.5, window)
        finally:
            ops.set_cpu_isa(previous)
        wide = ops.paged_decode(q, k_cache, v_cache, tables, context, 16, head_dim ** -0.5, window)
        assert torch.equal(wide, narrow)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_only_each_sequences_blocks(kv_dtype):
    """Poison every slot no sequence owns: a stray read would show up as NaN."""
    lens, block_size, head_dim = [3, 9], 4, 16
    q, k_cache, v_cache, tables, context = _case(lens, 4, 2, head_dim, block_size, seed=1, kv_dtype=kv_dtype)
    owned = set()
    for row, n in zip(tables.tolist(), lens):
        owned.update(row[b] * block_size + o for b in range(-(-n // block_size)) for o in range(block_size)
                     if b * block_size + o < n)
    for slot in range(k_cache.shape[0]):
        if slot not in owned:
            k_cache[slot] = float("nan")
            v_cache[slot] = float("nan")
    out = kernel(q, k_cache, v_cache, tables, context, block_size, head_dim ** -0.5, -1)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sliding_window", [None, 200])
@pytest.mark.parametrize("shares", [1, 2, 3])
def test_prefetched_rows_are_the_rows_attention_reads(kv_dtype, sliding_window, shares):
    """The decode plan prefetches, per thread, the pool rows its attention units read next: together
    the shares list every attended (sequence, kv head, position)'s row once, in the units' order (per
    sequence, its chunks of 128 positions in turn, each chunk's kv heads one after another)."""
    from llmopt.kernels.cpu_extension import cpu_ops

    lens, block_size, kv_heads, head_dim = [700, 129, 3, 257, 1], 16, 3, 64
    _, _, _, tables, context = _case(lens, 9, kv_heads, head_dim, block_size, seed=5)
    row_bytes = head_dim * torch.empty(0, dtype=kv_dtype).element_size()
    expected = []
    for b, n in enumerate(lens):
        start = 0 if sliding_window is None else max(0, n - sliding_window)
        for chunk in range(start, n, 128):
            for kh in range(kv_heads):
                for t in range(chunk, min(n, chunk + 128)):
                    slot = tables[b, t // block_size].item() * block_size + t % block_size
                    expected.append((slot * kv_heads + kh) * row_bytes)
    got = [cpu_ops().paged_decode_share_rows(context, tables, block_size, kv_heads, 3, head_dim,
                                             -1 if sliding_window is None else sliding_window, kv_dtype, s, shares)
           for s in range(shares)]
    assert torch.cat(got).tolist() == expected
    assert all(len(part) > 0 for part in got)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_runtime_greedy_same_with_and_without_kernel(tiny_models, kind):
    """The engine decodes through the kernel; switching to the PyTorch path changes no token."""
    from llmopt.loader import load
    from llmopt.runtime import SamplingParams
    from llmopt.runtime.llm import LLM

    model = load(str(tiny_models[kind]), dtype="float32")
    prompts = [[5, 17, 99, 3], list(range(3, 40)), [200, 13]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = {}
    for use_kernel in (True, False):
        llm = LLM(model, num_kv_blocks=64, block_size=4, max_model_len=128)
        if not use_kernel:
            llm.engine.runner.attn.cpu_decode = None
        else:
            assert llm.engine.runner.attn.cpu_decode is kernel
        outputs[use_kernel] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outputs[True] == outputs[False]
