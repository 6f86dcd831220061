"""The C++ skinny linear kernel against a float64 reference, and how DenseLinear dispatches to it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmopt.kernels.cpu_linear import SKINNY_MAX_ROWS, skinny_linear_kernel
from llmopt.model.backends import CpuBackend, ReferenceBackend
from llmopt.model.linear import DenseLinear

kernel = skinny_linear_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="the CPU kernels could not be built here (or no AVX2/FMA)")


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if bias is None else bias.double())


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 32, 96])
@pytest.mark.parametrize("n_in,n_out", [(576, 960), (1536, 576), (37, 13), (8, 1), (576, 49152)])
def test_matches_float64_reference(rows, n_in, n_out):
    gen = torch.Generator().manual_seed(rows * 1000 + n_out)
    x = torch.randn(rows, n_in, generator=gen)
    w = torch.randn(n_out, n_in, generator=gen) * n_in ** -0.5
    got = kernel(x, w)
    assert got.shape == (rows, n_out) and got.dtype == torch.float32
    ref = _reference(x, w, None)
    # fp32 dot products of length n_in: as close to float64 as MKL's own (checked beside it)
    tol = 4e-7 * n_in ** 0.5 * ref.abs().max().item() + 1e-6
    assert (got.double() - ref).abs().max().item() < tol
    assert (F.linear(x, w).double() - ref).abs().max().item() < tol


def test_bias_is_added():
    gen = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(5, 64, generator=gen), torch.randn(10, 64, generator=gen), torch.randn(10, generator=gen)
    torch.testing.assert_close(kernel(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernel(x, w, b) - kernel(x, w), b.expand(5, 10), rtol=1e-5, atol=1e-5)


def test_a_rows_result_does_not_depend_on_the_other_rows():
    """Bitwise: one sequence's logits are the same whatever else is in the decode batch."""
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(17, 576, generator=gen), torch.randn(963, 576, generator=gen)
    batch = kernel(x, w)
    for i in (0, 7, 16):
        assert torch.equal(kernel(x[i : i + 1].contiguous(), w)[0], batch[i])
    assert torch.equal(kernel(x[3:9].contiguous(), w), batch[3:9])


def test_rejects_what_it_cannot_do():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="fp32"):
        kernel(x.double(), w.double())
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel(torch.randn(8, 2).t(), w)
    with pytest.raises(RuntimeError, match=r"x \[M, K\]"):
        kernel(torch.randn(2, 9), w)


def test_dense_linear_uses_the_kernel_for_few_rows_only():
    gen = torch.Generator().manual_seed(5)
    layer = DenseLinear(64, 48, bias=True)
    layer.weight.data = torch.randn(48, 64, generator=gen)
    layer.bias.data = torch.randn(48, generator=gen)
    layer.prepare(CpuBackend())
    assert layer.skinny is kernel
    few = torch.randn(2, 3, 64, generator=gen)  # 6 rows, any leading shape
    out = layer(few)
    assert out.shape == (2, 3, 48)
    assert torch.equal(out.reshape(6, 48), kernel(few.reshape(6, 64), layer.weight, layer.bias))
    many = torch.randn(SKINNY_MAX_ROWS + 1, 64, generator=gen)
    assert torch.equal(layer(many), F.linear(many, layer.weight, layer.bias))  # MKL, as transformers
    # prepared again after a cast (the kernel is fp32 only), or for another backend: plain F.linear
    layer.to(torch.float64)
    layer.prepare(CpuBackend())
    assert layer.skinny is None and torch.equal(layer(few.double()), F.linear(few.double(), layer.weight, layer.bias))
    layer.to(torch.float32)
    layer.prepare(ReferenceBackend())
    assert layer.skinny is None and layer.onednn_weight is None and torch.equal(layer(few), F.linear(few, layer.weight, layer.bias))


@pytest.mark.parametrize("rows", [1, 2, 7, 33, 130])
def test_bf16_weights_match_their_float64_product(rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=gen)
    w = (torch.randn(1001, 576, generator=gen) * 576 ** -0.5).to(torch.bfloat16)
    got = kernel(x, w)
    ref = _reference(x, w.float(), None)  # the bf16 values exactly, widened
    assert (got.double() - ref).abs().max().item() < 4e-7 * 576 ** 0.5 * ref.abs().max().item() + 1e-6
    assert torch.equal(kernel(x[:1].contiguous(), w), got[:1])


def test_dense_linear_bf16_copy_serves_every_row_count():
    gen = torch.Generator().manual_seed(6)
    layer = DenseLinear(64, 40)
    layer.weight.data = torch.randn(40, 64, generator=gen)
    layer.prepare(CpuBackend())
    assert layer.use_compact_copy("bf16") and layer.bf16_weight.dtype == torch.bfloat16
    assert layer.weight.dtype == torch.float32  # the plain weight stays (tied embeddings read it)
    for rows in (1, SKINNY_MAX_ROWS + 5):
        x = torch.randn(rows, 64, generator=gen)
        assert torch.equal(layer(x), kernel(x, layer.bf16_weight))
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=0.02, atol=0.05)
