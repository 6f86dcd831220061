"""The C++ prompt attention kernel (`kernels/cpu_prefill_attention.py`) against the PyTorch path it replaces:
`attend` over each sequence's context keys and then its own, with the explicit prefill mask."""

from __future__ import annotations

import pytest
import torch

from llmopt.kernels.cpu_prefill_attention import prefill_attention_kernel
from llmopt.kernels.paged_attention import attend, prefill_mask

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
