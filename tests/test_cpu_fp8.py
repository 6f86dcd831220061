"""The C++ FP8 linear kernel (`kernels/csrc/fp8_linear.cpp`) against the PyTorch reference: every
e4m3 code widened exactly, rows 1..97, odd widths, batch invariance, each SIMD path this machine
has (capped with `set_cpu_isa`), and the layer the loader builds from a checkpoint."""

from __future__ import annotations

import pytest
import torch

from llmopt.core.fp8_weight import FP8_DTYPE, quantize_fp8
from llmopt.kernels.cpu_extension import cpu_ops
from llmopt.kernels.cpu_fp8 import fp8_linear_kernel, reference_fp8_linear

ops = cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="llmopt's CPU kernels could not be built here")


def _paths() -> list[str]:
    """The kernel's paths this build and CPU allow: the table always, AVX2 + F16C where present."""
    if ops is None:
        return []
    previous = ops.set_cpu_isa("avx2")
    try:
        simd = ops.fp8_linear_simd()
    finally:
        ops.set_cpu_isa(previous)
    return ["scalar", "avx2"] if simd else ["scalar"]


@pytest.fixture(params=["scalar", "avx2"])
def path(request):
    if request.param not in _paths():
        pytest.skip(f"fp8_linear's {request.param} path needs AVX2 + FMA + F16C in the build and CPU")
    previous = ops.set_cpu_isa(request.param)
    yield request.param
    ops.set_cpu_isa(previous)


def _weight(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return quantize_fp8(torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g))


def test_every_code_widens_exactly(path):
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # e4m3fn's NaN patterns are never written
    w = codes.repeat(3, 1)  # [3, 254]
    scales = torch.tensor([1.0, 0.5, 3.0e-3])
    x = torch.eye(w.shape[1])  # one weight per output element: no rounding in the sum
    out = fp8_linear_kernel()(x, w.contiguous(), scales, None)
    expected = (w.view(FP8_DTYPE).float() * scales[:, None]).t()
    assert torch.equal(out, expected)


@pytest.mark.parametrize("n,k", [(1, 1), (5, 7), (33, 13), (17, 97), (64, 576), (41, 579)])
def test_matches_reference_rows_1_to_97(path, n, k):
    q = _weight(n, k)
    codes, bias = q.codes.view(torch.uint8), torch.randn(n)
    x = torch.randn(97, k)
    kernel = fp8_linear_kernel()
    for rows in range(1, 98):
        out = kernel(x[:rows].contiguous(), codes, q.scales, bias)
        ref = reference_fp8_linear(x[:rows], q.codes, q.scales, bias)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * k ** 0.5)


def test_batch_invariant(path):
    q = _weight(70, 203, seed=1)
    codes = q.codes.view(torch.uint8)
    x = torch.randn(11, 203)
    kernel = fp8_linear_kernel()
    batch = kernel(x, codes, q.scales, None)
    for i in range(11):
        assert torch.equal(kernel(x[i:i + 1].contiguous(), codes, q.scales, None)[0], batch[i]), i
    assert torch.equal(kernel(x[3:9].contiguous(), codes, q.scales, None), batch[3:9])


def test_layer_runs_the_kernel_for_decode_rows_and_dequantizes_for_prompts():
    from llmopt.model.fp8_linear import cpu_fp8_linear

    q = _weight(48, 64, seed=2)
    layer = cpu_fp8_linear(q, torch.randn(48))
    assert layer is not None and layer.streamed_weight_bytes() == 48 * 64 + 48 * 4 + 48 * 4
    for rows in (1, 4, 200):  # 200 rows: past SKINNY_MAX_ROWS, dequantized for the call
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), reference_fp8_linear(x, q.codes, q.scales, layer.bias),
                                   rtol=1e-5, atol=1e-5)
    assert layer(torch.randn(2, 3, 64)).shape == (2, 3, 48)
