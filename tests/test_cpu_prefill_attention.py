"""The C++ prompt attention kernel (`kernels/cpu_prefill_attention.py`) against the PyTorch path it replaces:
`attend` over each sequence's context keys and then its own, with the explicit prefill mask."""

from __future__ import annotations

import pytest
import torch

from llmopt.kernels import cpu_prefill_attention
from llmopt.kernels.cpu_extension import cpu_ops
from llmopt.kernels.cpu_prefill_attention import bf16_products, kernel_math, prefill_attention_kernel
from llmopt.kernels.paged_attention import PROMPT_MATH_MIN_QUERIES, attend, prefill_mask

kernel = prefill_attention_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="the CPU kernels could not be built here (no g++/ninja)")

# (queries, context keys) per sequence: single queries, a block's edge (16), past a work item's run (256)
SEQUENCES = [(1, 0), (5, 0), (16, 0), (17, 3), (40, 0), (3, 20), (33, 7), (300, 12), (1, 9)]


def _packed(heads: int, kv_heads: int, head_dim: int, seed: int):
    """Queries packed flat; K/V rows: every sequence's own keys at its queries' rows, then the contexts."""
    gen = torch.Generator().manual_seed(seed)
    total_q = sum(n for n, _ in SEQUENCES)
    total_k = total_q + sum(c for _, c in SEQUENCES)
    q = torch.randn(total_q, heads, head_dim, generator=gen)
    k, v = (torch.randn(total_k, kv_heads, head_dim, generator=gen) for _ in range(2))
    segments, q_start, ctx_start = [], 0, total_q
    for n, ctx in SEQUENCES:
        segments.append([q_start, n, ctx_start, ctx, q_start])
        q_start, ctx_start = q_start + n, ctx_start + ctx
    return q, k, v, torch.tensor(segments)


def _reference(q, k, v, segments, window):
    out = torch.empty_like(q)
    for q_start, n, ctx_start, ctx, own in segments.tolist():
        keys = torch.cat([k[ctx_start:ctx_start + ctx], k[own:own + n]])
        values = torch.cat([v[ctx_start:ctx_start + ctx], v[own:own + n]])
        out[q_start:q_start + n] = attend(q[q_start:q_start + n], keys, values, prefill_mask(n, ctx, window, q.device))
    return out


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 16, 80, 128])
@pytest.mark.parametrize("window", [None, 5, 40])
def test_kernel_matches_pytorch_path(heads, kv_heads, head_dim, window):
    q, k, v, segments = _packed(heads, kv_heads, head_dim, seed=heads * 100 + head_dim)
    got = kernel(q, k, v, segments, head_dim ** -0.5, window or 0)
    torch.testing.assert_close(got, _reference(q, k, v, segments, window), rtol=1e-5, atol=1e-5)


def test_kernel_scale_is_applied():
    q, k, v, segments = _packed(4, 2, 16, seed=1)
    got = kernel(q, k, v, segments, 0.5, 0)
    expected = _reference(q * (0.5 / 16 ** -0.5), k, v, segments, None)  # SDPA's default scale is head_dim ** -0.5
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_kernel_rejects_what_it_cannot_take():
    q, k, v, segments = _packed(4, 2, 16, seed=2)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernel(q[..., :12].contiguous(), k[..., :12].contiguous(), v[..., :12].contiguous(), segments, 1.0, 0)
    bad = segments.clone()
    bad[0, 4] = k.shape[0]  # own keys past the end
    with pytest.raises(RuntimeError, match="keys out of range"):
        kernel(q, k, v, bad, 1.0, 0)
    with pytest.raises(RuntimeError, match="fp32"):
        kernel(q.bfloat16(), k.bfloat16(), v.bfloat16(), segments, 1.0, 0)


needs_bf16_products = pytest.mark.skipif(kernel is None or not bf16_products(),
                                         reason="the kernel's bf16 products need AVX512-BF16 (this CPU or build lacks it)")


@needs_bf16_products
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 16, 80, 128])
@pytest.mark.parametrize("window", [None, 40])
def test_bf16_products_match_the_reference_on_rounded_inputs(heads, kv_heads, head_dim, window):
    """bf16 products: the float64 reference over the bf16-rounded q, K, V, up to the softmax weights' bf16 rounding
    (relative 2^-9 each); and not the fp32 kernel's result (the bf16 path did run)."""
    q, k, v, segments = _packed(heads, kv_heads, head_dim, seed=heads * 10 + head_dim)
    got = kernel(q, k, v, segments, head_dim ** -0.5, window or 0, True)
    rounded = [t.bfloat16().double() for t in (q, k, v)]
    expected = _reference(*rounded, segments, window)
    error = (got.double() - expected).abs()
    assert error.max() < 2e-2 and error.mean() < 2e-3
    assert (got - kernel(q, k, v, segments, head_dim ** -0.5, window or 0)).abs().max() > 1e-4


@needs_bf16_products
def test_bf16_products_refused_where_they_cannot_run():
    q, k, v, segments = _packed(4, 2, 16, seed=3)
    previous = cpu_ops().set_cpu_isa("avx2")
    try:
        assert not bf16_products()
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            kernel(q, k, v, segments, 1.0, 0, True)
    finally:
        cpu_ops().set_cpu_isa(previous)


@pytest.mark.parametrize("way,products", [("avx512_bf16", True), ("avx512_bf16", False), ("amx", True), ("emulated", False)])
def test_kernel_math_by_chunk_size_and_cpu(way, products, monkeypatch):
    """fp32 products without a math dtype or below PROMPT_MATH_MIN_QUERIES queries; bf16 ones for prompt-sized chunks
    where they run and the CPU has no AMX (there SDPA's bf16 runs on the tiles); else SDPA (None)."""
    monkeypatch.setattr(cpu_prefill_attention, "bf16_way", lambda: way)
    monkeypatch.setattr(cpu_prefill_attention, "bf16_products", lambda: products)
    q = torch.zeros(4, 2, 16)
    assert kernel_math(q, None, 500) == "fp32"
    assert kernel_math(q, torch.bfloat16, PROMPT_MATH_MIN_QUERIES - 1) == "fp32"
    big = kernel_math(q, torch.bfloat16, PROMPT_MATH_MIN_QUERIES)
    assert big == ("bf16" if way == "avx512_bf16" and products else None)
    assert cpu_prefill_attention.bf16_prompt_attention() == (way == "amx" or (way == "avx512_bf16" and products))
    assert kernel_math(q.bfloat16(), None, 500) is None  # the kernel takes fp32 queries only
