"""Prompt attention without a mask: `causal_mask` hands SDPA `is_causal` where a chunk starts its
sequence and no sliding window cuts it, and the explicit mask everywhere else; both give what the
explicit mask gives."""

from __future__ import annotations

import pytest
import torch

from llmopt.kernels.paged_attention import attend, causal_mask, prefill_mask
from llmopt.model.attention import EqualLengthAttention


@pytest.mark.parametrize("query_len,context_len,window", [(1, 0, None), (37, 0, None), (37, 0, 40), (37, 0, 8),
                                                          (37, 5, None), (3, 20, 4)])
def test_causal_mask_attends_as_the_explicit_mask(query_len, context_len, window):
    gen = torch.Generator().manual_seed(query_len + context_len)
    q = torch.randn(query_len, 6, 16, generator=gen)
    k, v = (torch.randn(context_len + query_len, 2, 16, generator=gen) for _ in range(2))
    mask, is_causal = causal_mask(query_len, context_len, window, q.device)
    assert is_causal == (context_len == 0 and query_len > 1 and (window is None or query_len <= window))
    assert (mask is None) == (is_causal or prefill_mask(query_len, context_len, window, q.device) is None)
    expected = attend(q, k, v, prefill_mask(query_len, context_len, window, q.device))
    torch.testing.assert_close(attend(q, k, v, mask, is_causal), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("window", [None, 5])
def test_equal_length_windows_attend_causally(window):
    gen = torch.Generator().manual_seed(7)
    b, t = 3, 24
    q = torch.randn(b * t, 6, 16, generator=gen)
    k, v = (torch.randn(b * t, 2, 16, generator=gen) for _ in range(2))
    got = EqualLengthAttention(b, t).forward(0, q, k, v, window)
    for i in range(b):
        rows = slice(i * t, (i + 1) * t)
        expected = attend(q[rows], k[rows], v[rows], prefill_mask(t, 0, window, q.device))
        torch.testing.assert_close(got[rows], expected, rtol=1e-5, atol=1e-5)  # the C++ kernel where it is built
