"""The C++ rounding-error kernel AWQ's searches use (kernels/cpu_fake_quant.py) against the
PyTorch operations it replaces, bit for bit, on the grids and corner cases the quantizer has."""

from __future__ import annotations

import pytest
import torch

from llmopt.kernels.cpu_extension import cpu_ops
from llmopt.kernels.cpu_fake_quant import fake_quant_error
from llmopt.quant import awq
from llmopt.quant.quantizer import QuantScheme, fake_quantize

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="llmopt's CPU kernels are not built here (no compiler)")


def _weights(rows: int, n: int, width: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, n, generator=gen) * 0.05
    groups = w.view(rows, n // width, width)
    groups[0, 0] = groups[0, 0].abs()  # no negative value: the zero point 0 -> 1 case
    groups[1 % rows, -1] = -groups[1 % rows, -1].abs()  # no positive value
    groups[2 % rows, 0] = 0.0  # an all-zero group: the scale's floor
    groups[3 % rows, -1] *= 1e-7  # tiny values: the scale's floor again
    w[4 % rows, 5] = 3.0  # an outlier
    return w


def _reference(w, scheme, col_scale=None, limit=None):
    width = scheme.group_width(w.shape[1])
    v = w if col_scale is None else w * col_scale
    if limit is not None:
        grouped = v.reshape(w.shape[0], -1, width)
        v = torch.clamp(grouped, -limit, limit).reshape(w.shape)
    w_hat = fake_quantize(v, scheme)
    return (w_hat if col_scale is None else w_hat.div_(col_scale)).sub_(w)


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("bits", [4, 3, 8])
def test_kernel_equals_pytorch_bitwise(sym, group_size, bits):
    scheme = QuantScheme(bits=bits, group_size=group_size, sym=sym)
    rows, n = 37, 384
    width = scheme.group_width(n)
    w = _weights(rows, n, width, seed=bits * 100 + max(group_size, 0))
    gen = torch.Generator().manual_seed(7)
    col_scale = torch.rand(n, generator=gen) * 4 + 0.05
    max_abs = w.reshape(rows, -1, width).abs().amax(dim=-1, keepdim=True)
    limit = max_abs * 0.7
    for kwargs in ({}, {"col_scale": col_scale}, {"limit": limit}, {"col_scale": col_scale, "limit": limit}):
        expected = _reference(w, scheme, **kwargs)
        flat_limit = None if "limit" not in kwargs else limit.reshape(rows, -1)
        got = fake_quant_error(w, width, scheme.max_code, scheme.sym, kwargs.get("col_scale"), flat_limit)
        assert got is not None
        mismatched = (got != expected).sum().item()
        assert mismatched == 0, f"{mismatched} of {got.numel()} differ ({sorted(kwargs)})"


def test_kernel_declines_what_it_cannot_run():
    w = torch.randn(4, 64)
    assert fake_quant_error(w.double(), 32, 15, False) is None
    assert fake_quant_error(w, 32, 15, False, col_scale=torch.ones(64, dtype=torch.float64)) is None


def test_searches_choose_the_same_with_and_without_the_kernel(monkeypatch):
    """AWQ's scale and clip searches give identical results on either path (the kernel's
    error is the reference's bitwise, the clip search's up to a sign its losses square away)."""
    scheme = QuantScheme(bits=4, group_size=32, sym=False)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(300, 128, generator=gen) * torch.linspace(0.1, 4, 128)
    w = torch.randn(96, 128, generator=gen) * 0.1
    fast_scale = awq.search_scale(x, w, scheme, n_grid=8, search_tokens=128)
    fast_clip = awq.search_clip(x, w, scheme, n_grid=8)
    monkeypatch.setattr(awq, "fake_quant_error", lambda *args, **kwargs: None)
    slow_scale = awq.search_scale(x, w, scheme, n_grid=8, search_tokens=128)
    slow_clip = awq.search_clip(x, w, scheme, n_grid=8)
    assert torch.equal(fast_scale[0], slow_scale[0]) and fast_scale[1] == slow_scale[1]
    assert torch.equal(fast_clip, slow_clip)
    assert not torch.equal(fast_clip, w)  # the search clipped something: the comparison has content
