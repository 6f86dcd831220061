"""The C++ int4 kernel (`llmopt.kernels.cpu_int4`) against its PyTorch reference and the
dequantize-then-matmul path, on weights read back from AWQ and GPTQ checkpoint layouts; and
the int8 (Q8_0) kernel the vocabulary projection of int4 models uses. Each SIMD path this CPU
has (scalar, AVX2, AVX-512 VNNI, AMX) runs against the reference and bitwise against the
others; the paths it lacks skip with the reason."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from llmopt.kernels.cpu_extension import cpu_ops
from llmopt.kernels.cpu_int4 import (dequantize, dequantize_int8, int4_linear_kernel, int8_linear_kernel,
                                     quantize_activations, reference_int4_linear, reference_int8_linear, repack_int4,
                                     repack_int8)
from llmopt.core.quant_formats import pack_tensors, unpack_tensors
from llmopt.quant.quantizer import QuantizedWeight, QuantScheme, quantize_rtn

kernel = int4_linear_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="the CPU kernels could not be built here")

PATHS = ["scalar", "avx2", "avx512", "amx"]  # csrc/isa.h, narrowest first


@pytest.fixture(params=PATHS)
def cpu_path(request):
    """Runs the test with the kernels capped at one SIMD path (skipped where this build and CPU lack it)."""
    ops = cpu_ops()
    supported = ops.cpu_isa_supported()
    if PATHS.index(request.param) > PATHS.index(supported):
        pytest.skip(f"the {request.param} path: this build and CPU reach {supported}")
    previous = ops.set_cpu_isa(request.param)
    yield request.param
    ops.set_cpu_isa(previous)


def checkpoint_weight(fmt: str, out_features: int, in_features: int, group_size: int, act_order: bool,
                      seed: int) -> QuantizedWeight:
    """An RTN-quantized random weight written in `fmt`'s packed layout and read back as the loader does."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5
    q = quantize_rtn(w, QuantScheme(group_size=group_size))
    if act_order:  # GPTQ desc_act: columns assigned to groups in a permuted order
        g_idx = q.g_idx[torch.randperm(in_features, generator=gen)]
        q = QuantizedWeight(q.codes, q.scales, q.zeros, g_idx, q.scheme)
    tensors = pack_tensors(fmt, "p", q)
    return unpack_tensors(fmt, tensors, "p", 4, group_size)


def run(x: torch.Tensor, packed, bias=None) -> torch.Tensor:
    return kernel(x, packed.codes, packed.scales, packed.zeros, packed.out_features, packed.group_size, packed.perm,
                  bias)


LAYOUTS = [("awq", 32, False), ("awq", 64, False), ("awq", 128, False), ("awq", -1, False),
           ("gptq", 64, False), ("gptq", 128, True), ("gptq", 32, True), ("gptq", -1, False)]


@pytest.mark.parametrize("fmt,group_size,act_order", LAYOUTS)
@pytest.mark.parametrize("rows", [1, 2, 5, 33, 97])
def test_kernel_matches_reference(fmt, group_size, act_order, rows, cpu_path):
    out_features, in_features = (200, 256) if group_size != 32 else (72, 576)  # odd tile counts: 200 = 4 * 50, 72 = 4 * 18
    q = checkpoint_weight(fmt, out_features, in_features, group_size, act_order, seed=rows)
    packed = repack_int4(q.codes, q.scales, q.zeros, q.g_idx)
    assert packed is not None and (packed.perm is not None) == act_order
    torch.testing.assert_close(dequantize(packed), q.dequantize(), rtol=0, atol=1e-6)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(7))
    got = run(x, packed)
    ref = reference_int4_linear(x, packed)
    # same int8 codes and integer dots; only fp32 rounding of the block sums differs
    assert (got - ref).abs().max().item() < 1e-5 * ref.abs().max().item() + 1e-6
    # against fp32 activations (the dequantized path): the int8 rounding, ~0.4% per 32 values
    dense = x @ q.dequantize().T
    rel = ((got - dense).norm() / dense.norm()).item()
    assert rel < 0.01, rel


@pytest.mark.parametrize("out_features", [1, 3, 5, 7, 13])
def test_odd_output_widths(out_features, cpu_path):
    q = checkpoint_weight("gptq", out_features * 8, 64, 32, False, seed=out_features)
    codes, scales, zeros = q.codes[:out_features], q.scales[:out_features], q.zeros[:out_features]
    packed = repack_int4(codes, scales, zeros, q.g_idx)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    ref = reference_int4_linear(x, packed)
    assert (run(x, packed) - ref).abs().max().item() < 1e-5 * ref.abs().max().item() + 1e-6


def test_rows_do_not_depend_on_the_batch(cpu_path):
    """Bitwise: a row's output is the same alone, in any batch size, at any position."""
    q = checkpoint_weight("awq", 136, 576, 64, False, seed=3)
    packed = repack_int4(q.codes, q.scales, q.zeros, q.g_idx)
    x = torch.randn(97, 576, generator=torch.Generator().manual_seed(4))
    full = run(x, packed)
    for rows in (1, 2, 3, 4, 5, 8, 31):
        assert torch.equal(run(x[:rows].contiguous(), packed), full[:rows])
    assert torch.equal(run(x[50:51].contiguous(), packed), full[50:51])
    assert torch.equal(run(x.flip(0).contiguous(), packed), full.flip(0))


def test_bias_and_zero_rows(cpu_path):
    q = checkpoint_weight("awq", 64, 128, 64, False, seed=5)
    packed = repack_int4(q.codes, q.scales, q.zeros, q.g_idx)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(6))
    bias = torch.randn(64, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(run(x, packed, bias) - run(x, packed), bias.expand(4, 64), rtol=1e-5, atol=1e-5)
    assert run(torch.empty(0, 128), packed).shape == (0, 64)
    x[1] = 0  # an all-zero block has scale 0: its codes are 0, not NaN
    assert torch.isfinite(run(x, packed)).all() and (run(x, packed)[1] == 0).all()


def test_compact_and_fp32_scale_layouts_agree_bitwise(cpu_path):
    """fp16 scales with uint8 zeros (what checkpoints hold) and fp32 scales with fp32 scale * zero give
    bitwise the same outputs (s * zero is exact in fp32 either way); scales that are not fp16 values, or
    zeros that are not bytes, keep the fp32 layout."""
    q = checkpoint_weight("awq", 200, 576, 64, False, seed=21)
    packed = repack_int4(q.codes, q.scales, q.zeros, q.g_idx)
    assert packed.compact and packed.scales.dtype == torch.float16 and packed.zeros.dtype == torch.uint8
    wide = replace(packed, scales=packed.scales.float(), zeros=packed.scaled_zeros())
    assert not wide.compact and wide.zeros.dtype == torch.float32
    x = torch.randn(97, 576, generator=torch.Generator().manual_seed(22))
    for rows in (1, 3, 8, 16, 97):
        assert torch.equal(run(x[:rows].contiguous(), packed), run(x[:rows].contiguous(), wide))
    assert torch.equal(dequantize(packed), dequantize(wide))
    off_grid = repack_int4(q.codes, q.scales.float() * (1 + 2 ** -14), q.zeros, q.g_idx)
    fractional = repack_int4(q.codes, q.scales, q.zeros.float() + 0.5, q.g_idx)
    for p in (off_grid, fractional):
        assert not p.compact and p.scales.dtype == torch.float32 and p.zeros.dtype == torch.float32
        assert (run(x[:5].contiguous(), p) - reference_int4_linear(x[:5], p)).abs().max() < 1e-4
    with pytest.raises(RuntimeError, match="scales fp16 with zeros uint8"):
        run(x[:1].contiguous(), replace(packed, zeros=packed.scaled_zeros()))


def paths_here() -> list[str]:
    ops = cpu_ops()
    return PATHS[: PATHS.index(ops.cpu_isa_supported()) + 1] if ops is not None else []


def each_path(fn) -> dict[str, torch.Tensor]:
    """fn() under each SIMD path this CPU has, the cap restored after."""
    ops, out = cpu_ops(), {}
    for path in paths_here():
        previous = ops.set_cpu_isa(path)
        try:
            out[path] = fn()
        finally:
            ops.set_cpu_isa(previous)
    return out


@pytest.mark.skipif(len(paths_here()) < 2, reason="one SIMD path on this CPU: nothing to compare")
@pytest.mark.parametrize("fmt,group_size,act_order,out_features,in_features",
                         [("awq", 64, False, 200, 576), ("gptq", 32, True, 72, 1536), ("gptq", 128, True, 24, 256),
                          ("awq", -1, False, 8, 96), ("awq", 32, False, 136, 64)])
def test_paths_agree_bitwise(fmt, group_size, act_order, out_features, in_features):
    """Integer block dots are exact and every path does the same fp32 steps in the same order:
    the outputs are bitwise equal, for every row count (decode, batched decode, prompt chunks
    on both sides of the AMX threshold, several of the VNNI path's row runs), odd tile counts, act-order and bias."""
    q = checkpoint_weight(fmt, out_features, in_features, group_size, act_order, seed=out_features)
    packed = repack_int4(q.codes, q.scales, q.zeros, q.g_idx)
    x = torch.randn(150, in_features, generator=torch.Generator().manual_seed(11))
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(12))
    for rows in (1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 31, 32, 33, 48, 97, 150):
        xs = x[:rows].contiguous()
        outs = each_path(lambda: run(xs, packed, bias))
        for path, out in outs.items():
            assert torch.equal(out, outs["avx2"]), (path, rows)
    ref = reference_int4_linear(x, packed, bias)
    assert (outs["avx2"] - ref).abs().max().item() < 1e-5 * ref.abs().max().item() + 1e-6


@pytest.mark.skipif(len(paths_here()) < 2, reason="one SIMD path on this CPU: nothing to compare")
def test_int8_paths_agree_bitwise():
    gen = torch.Generator().manual_seed(13)
    packed = repack_int8(torch.randn(40, 608, generator=gen) * 0.05)  # 5 tiles, 19 blocks
    x = torch.randn(37, 608, generator=gen)
    for rows in (1, 2, 4, 5, 8, 37):  # from 2 rows the AVX-512 path takes VNNI
        xs = x[:rows].contiguous()
        outs = each_path(lambda: int8_kernel(xs, packed.codes, packed.scales, packed.out_features))
        for path, out in outs.items():
            assert torch.equal(out, outs["avx2"]), (path, rows)


def test_activation_codes_round_half_to_even_like_the_kernel():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5] + [0.0] * 26])
    q, d = quantize_activations(x)
    assert d.item() == 1.0 and q[0, 0, :6].tolist() == [127.0, 0.0, 2.0, 2.0, -0.0, -2.0]
    packed = repack_int4(torch.full((8, 32), 9), torch.ones(8, 1), torch.full((8, 1), 8), torch.zeros(32, dtype=torch.int32))
    assert run(x, packed)[0, 0].item() == 127 + 0 + 2 + 2 + 0 - 2  # weights all exactly 1


def test_layouts_the_kernel_cannot_take_are_refused():
    codes, scales, zeros = torch.zeros(8, 48, dtype=torch.uint8), torch.ones(8, 3), torch.zeros(8, 3)
    assert repack_int4(codes, scales, zeros, torch.arange(48) // 16) is None  # K not a multiple of 32
    codes, scales, zeros = torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8, 4), torch.zeros(8, 4)
    assert repack_int4(codes, scales, zeros, torch.arange(64) // 16) is None  # groups of 16 split a block
    # uneven act-order groups that still fill whole blocks: one scale per block of 32
    g_idx = torch.tensor([0] * 32 + [1] * 64 + [2] * 32)[torch.randperm(128, generator=torch.Generator().manual_seed(0))]
    scales = torch.rand(8, 3) + 0.5
    zeros = torch.randint(0, 16, (8, 3))
    codes = torch.randint(0, 16, (8, 128), generator=torch.Generator().manual_seed(1))
    packed = repack_int4(codes, scales, zeros, g_idx)
    assert packed is not None and packed.group_size == 32
    ref = QuantizedWeight(codes, scales, zeros, g_idx.int(), QuantScheme(group_size=32)).dequantize()
    torch.testing.assert_close(dequantize(packed), ref, rtol=1e-6, atol=1e-5)  # s*c - s*z vs (c - z)*s


int8_kernel = int8_linear_kernel()


@pytest.mark.parametrize("rows", [1, 3, 4, 33])
@pytest.mark.parametrize("out_features", [8, 13, 200])
def test_int8_kernel_matches_reference(rows, out_features, cpu_path):
    gen = torch.Generator().manual_seed(rows * 100 + out_features)
    w = torch.randn(out_features, 576, generator=gen) * 0.05
    packed = repack_int8(w)
    # Q8_0: each weight within half a step (max|w| / 127 / 2) of its block's scale grid
    step = w.reshape(out_features, -1, 32).abs().amax(-1, keepdim=True) / 127
    assert ((dequantize_int8(packed) - w).reshape(out_features, -1, 32).abs() <= step / 2 + 1e-7).all()
    x = torch.randn(rows, 576, generator=gen)
    got = int8_kernel(x, packed.codes, packed.scales, packed.out_features)
    ref = reference_int8_linear(x, packed)
    assert (got - ref).abs().max().item() < 1e-5 * ref.abs().max().item() + 1e-6
    single = int8_kernel(x[-1:].contiguous(), packed.codes, packed.scales, packed.out_features)
    assert torch.equal(single, got[-1:])  # batch-invariant, bitwise
    assert ((got - x @ w.T).norm() / (x @ w.T).norm()).item() < 0.02  # int8 x and w: ~0.8% on gaussian rows


def test_dense_linear_int8_copy():
    gen = torch.Generator().manual_seed(9)
    from llmopt.model.backends import CpuBackend
    from llmopt.model.linear import DenseLinear

    layer = DenseLinear(64, 24, bias=True)
    layer.weight.data = torch.randn(24, 64, generator=gen)
    layer.bias.data = torch.randn(24, generator=gen)
    layer.prepare(CpuBackend())
    assert layer.use_compact_copy("int8")
    x = torch.randn(130, 64, generator=gen)  # more rows than the skinny limit: still the int8 copy
    q = layer.int8_weight
    assert torch.equal(layer(x), int8_kernel(x, q.codes, q.scales, q.out_features) + layer.bias)
    with pytest.raises(ValueError, match="bf16 or int8"):
        layer.use_compact_copy("fp8")
