"""The fused C++ per-layer ops against the decoder's PyTorch reference code."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmopt.kernels.cpu_fused import fused_ops
from llmopt.model import ops as model_ops
from llmopt.model.llama import RMSNorm
from llmopt.model.backends import CpuBackend, ReferenceBackend, select_backend
from llmopt.model.ops import apply_rotary

ops = fused_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="the CPU kernels could not be built here (or no AVX2/FMA)")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows,hidden", [(1, 576), (32, 576), (300, 64), (5, 13)])
def test_rms_norm_and_fused_add(rows, hidden):
    gen = _gen(rows + hidden)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.rand(hidden, generator=gen) + 0.5
    x, residual = torch.randn(rows, hidden, generator=gen) * 3, torch.randn(rows, hidden, generator=gen)
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, norm.eps), model_ops.rms_norm(x, norm.weight, norm.eps), rtol=2e-6, atol=2e-6)
    out, summed = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(summed, residual + x)  # one fp32 add: exact
    torch.testing.assert_close(out, model_ops.rms_norm(residual + x, norm.weight, norm.eps), rtol=2e-6, atol=2e-6)
    # the module given the "cpu" ops runs the fused op on fp32 CPU rows, and the inputs are left alone
    norm.ops = CpuBackend().decoder_ops(torch.float32)
    x_before = x.clone()
    got_out, got_summed = norm(x, residual=residual)
    assert torch.equal(got_out, out) and torch.equal(got_summed, summed) and torch.equal(x, x_before)
    # bf16 x (a prompt product's bf16 result): bitwise what fp32 x widened from it gives
    x16 = x.bfloat16()
    out16, summed16 = ops.add_rms_norm(x16, residual, norm.weight, norm.eps)
    want_out, want_summed = ops.add_rms_norm(x16.float(), residual, norm.weight, norm.eps)
    assert out16.dtype == summed16.dtype == torch.float32
    assert torch.equal(out16, want_out) and torch.equal(summed16, want_summed)
    assert torch.equal(summed16, residual + x16)  # PyTorch's promotion: the reference takes bf16 x too


def test_rotary_in_place_on_strided_views():
    gen = _gen(1)
    n, heads, kv_heads, d = 7, 9, 3, 64
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(n, heads, d), k.view(n, kv_heads, d)
    angles = torch.rand(n, d // 2, generator=gen) * 20
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * d:].clone()
    ops.rotary_embedding_(q, k, cos, sin)
    torch.testing.assert_close(q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v_before)  # v untouched


@pytest.mark.parametrize("rows,inter", [(1, 1536), (32, 1536), (3, 13)])
def test_silu_and_mul(rows, inter):
    gen = _gen(rows + inter)
    x = torch.randn(rows, 2 * inter, generator=gen) * 6
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -30.0])  # saturation and zero
    gate, up = x.split(inter, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(gate) * up, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (130, 1536), (3, 13)])
def test_silu_and_mul_on_bf16_rows_is_the_fp32_result_rounded_once(rows, inter):
    """bf16 in and out: the fp32 op on the widened input, rounded to bf16 as PyTorch rounds (bitwise; NaN any NaN),
    the vector path and the scalar tail alike; and not the op computed in bf16."""
    gen = _gen(rows * inter)
    x = (torch.randn(rows, 2 * inter, generator=gen) * 6).bfloat16()
    x[0, :3] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    got = ops.silu_and_mul(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, inter)
    torch.testing.assert_close(got, ops.silu_and_mul(x.float()).bfloat16(), rtol=0, atol=0, equal_nan=True)
    if rows > 1:
        gate, up = x.split(inter, dim=-1)
        assert not torch.equal(got[1:], (F.silu(gate) * up)[1:])  # bf16 arithmetic rounds twice


@pytest.mark.skipif(ops is None or ops.cpu_isa_supported() not in ("avx512", "amx"),
                    reason="the AVX-512 path needs AVX-512 F/BW/VL/VNNI (this CPU or build lacks them)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_avx512_path_is_bitwise_the_avx2_one(dtype):
    """16 lanes take the 8-lane steps per lane: the same bits, columns past the last 16 (and 8) included."""
    gen = _gen(7)
    x = (torch.randn(37, 2 * (1536 + 8 + 5), generator=gen) * 6).to(dtype)
    x[0, :3] = torch.tensor([float("nan"), 100.0, -100.0])
    previous = ops.set_cpu_isa("avx2")
    try:
        narrow = ops.silu_and_mul(x)
    finally:
        ops.set_cpu_isa(previous)
    wide = ops.silu_and_mul(x)
    torch.testing.assert_close(wide, narrow, rtol=0, atol=0, equal_nan=True)


def test_bad_shapes_are_refused():
    with pytest.raises(RuntimeError, match="2 \\* I"):
        ops.silu_and_mul(torch.randn(2, 3))
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        ops.silu_and_mul(torch.randn(2, 4).half())
    with pytest.raises(RuntimeError, match="hidden"):
        ops.rms_norm(torch.randn(2, 4), torch.ones(5), 1e-6)
    with pytest.raises(RuntimeError, match="unit stride"):
        ops.rotary_embedding_(torch.randn(2, 8, 3).transpose(1, 2), torch.randn(2, 3, 8), torch.ones(2, 8), torch.ones(2, 8))


def test_chosen_once_at_load_for_fp32_cpu_only(tiny_models, monkeypatch):
    from llmopt.loader import load

    assert select_backend(torch.device("cpu"), torch.float32).name == "cpu"
    assert select_backend(torch.device("cpu"), torch.bfloat16).name == "cpu"  # its int4 layers: PyTorch's CPU kernel
    assert CpuBackend().decoder_ops(torch.float32).backend == "cpu"
    assert ReferenceBackend().decoder_ops(torch.float32) is model_ops.REFERENCE_OPS
    bf16 = CpuBackend().decoder_ops(torch.bfloat16)  # the fused ops are fp32 only
    assert bf16.backend == "cpu" and bf16.rms_norm is model_ops.rms_norm
    for dtype, backend in (("float32", "cpu"), ("bfloat16", "cpu")):
        model = load(str(tiny_models["llama"]), dtype=dtype).model
        assert {m.ops.backend for m in model.modules() if hasattr(m, "ops")} == {backend}
    monkeypatch.setenv("LLMOPT_KERNELS", "reference")
    assert select_backend(torch.device("cpu"), torch.float32).name == "reference"
    model = load(str(tiny_models["llama"])).model
    assert {m.ops.backend for m in model.modules() if hasattr(m, "ops")} == {"reference"}
    monkeypatch.setenv("LLMOPT_KERNELS", "fastest")
    with pytest.raises(ValueError, match="LLMOPT_KERNELS"):
        select_backend(torch.device("cpu"), torch.float32)
