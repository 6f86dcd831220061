"""The Triton int4 dequant-matmul (`llmopt.kernels.triton_int4`) against its fp32 PyTorch
reference, for AWQ-like (sequential) and GPTQ act-order (permuted g_idx) weights, on every
path; and `TritonInt4Linear` built from checkpoint-layout weights.

Without CUDA the kernels run in Triton's interpreter on CPU (TRITON_INTERPRET=1, set here
before Triton is imported); with CUDA they run compiled, bf16 included (`tl.dot` on bf16
is wrong in the interpreter). Tolerances are relative to the output's max |value|:
fp32 1e-5 (fp32 dot, summation order only), fp16 2e-3 and bf16 3e-2 (the dequantized
weight is rounded to x's dtype before the dot, and the output is rounded to it). Worst
seen in the interpreter: fp32 6e-7, fp16 4.6e-4.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated: before the first import
pytest.importorskip("triton")

from llmopt.kernels import triton_int4_kernels  # noqa: E402
from llmopt.kernels.triton_int4 import (PathThresholds, choose_path, dequantize, int4_matmul, pack_int4,  # noqa: E402
                                        reference_int4_matmul, unpack_codes)
from llmopt.quant.quantizer import QuantizedWeight, QuantScheme, quantize_rtn  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU tensors need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]),
]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}
# paths for the test shapes: M 1-2 gemv, 3-16 split-K, 17-63 tiled GEMM, 64+ dequantize + torch matmul
TEST_THRESHOLDS = PathThresholds(gemv_max_rows=2, splitk_max_rows=16, dequant_min_rows=64)
ROWS = [1, 2, 3, 7, 16, 17, 33, 67]
# (group size, K, N): K a multiple of the group but not of the 64/128 tiles; N not of 64.
# Per-channel K=200 is not even a multiple of 8 (the packing pads it).
SHAPES = [(32, 160, 72), (64, 192, 200), (128, 256, 72), (-1, 200, 136)]


def quantized(out_features: int, in_features: int, group_size: int, act_order: bool, seed: int) -> QuantizedWeight:
    """A random weight through llmopt's RTN quantizer; act-order: groups assigned to columns in a
    permuted order, as GPTQ desc_act checkpoints store them."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5
    q = quantize_rtn(w, QuantScheme(group_size=group_size))
    if act_order:
        q = QuantizedWeight(q.codes, q.scales, q.zeros, q.g_idx[torch.randperm(in_features, generator=gen)], q.scheme)
    return q


def check_close(got: torch.Tensor, x: torch.Tensor, packed, bias: torch.Tensor | None) -> None:
    ref = reference_int4_matmul(x.float(), packed, None if bias is None else bias.float())  # fp32 throughout
    assert got.dtype == x.dtype and got.shape == ref.shape
    err = (got.float() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= TOLERANCE[x.dtype] * scale, (err, scale)


def dtypes_for(device: str) -> list[torch.dtype]:
    return [torch.float16, torch.float32] + ([torch.bfloat16] if device == "cuda" else [])


# AWQ: sequential g_idx; GPTQ desc_act: permuted (a single per-channel group has no order to permute)
CASES = [("awq", *shape) for shape in SHAPES] + [("gptq-act-order", *shape) for shape in SHAPES if shape[0] != -1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("origin,group_size,in_features,out_features", CASES)
@pytest.mark.parametrize("rows", ROWS)
def test_matmul_matches_reference(device, origin, group_size, in_features, out_features, rows):
    act_order = origin == "gptq-act-order"
    q = quantized(out_features, in_features, group_size, act_order, seed=rows + in_features)
    packed = pack_int4(q.codes, q.scales, q.zeros, q.g_idx)
    assert (packed.perm is not None) == act_order
    assert torch.equal(dequantize(packed), q.dequantize())  # the repacking is lossless
    packed = packed.to(device)
    gen = torch.Generator().manual_seed(rows)
    bias = torch.randn(out_features, generator=gen) if rows % 2 else None
    for dtype in dtypes_for(device):
        x = torch.randn(rows, in_features, generator=gen).to(device, dtype)
        b = None if bias is None else bias.to(device, dtype)
        check_close(int4_matmul(x, packed, b, TEST_THRESHOLDS), x, packed, b)


def test_paths_by_row_count():
    assert [choose_path(m, TEST_THRESHOLDS) for m in ROWS] == \
        ["gemv"] * 2 + ["splitk"] * 3 + ["gemm"] * 2 + ["dequant"]
    assert [choose_path(m) for m in (1, 2, 16, 17, 255, 256, 4096)] == \
        ["gemv", "splitk", "splitk", "gemm", "gemm", "dequant", "dequant"]


def test_split_k_fills_the_programs_but_keeps_a_tile_each():
    cpu = torch.device("cpu")
    assert triton_int4_kernels._split_k(cpu, programs=2, k_tiles=5) == 4  # 2 x 4 = 2 per stand-in SM
    assert triton_int4_kernels._split_k(cpu, programs=2, k_tiles=2) == 2  # no empty K slices
    assert triton_int4_kernels._split_k(cpu, programs=64, k_tiles=8) == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path_rows", [1, 5, 20, 70])
def test_scales_gathered_per_column(device, path_rows):
    """Groups 24 wide divide no power-of-two tile: scales and zeros are loaded per input column."""
    q = quantized(40, 96, 24, act_order=True, seed=path_rows)
    packed = pack_int4(q.codes, q.scales, q.zeros, q.g_idx)
    assert packed.group_size == 24 and triton_int4_kernels._block_k(packed, 32) == (32, False)
    packed = packed.to(device)
    x = torch.randn(path_rows, 96, generator=torch.Generator().manual_seed(0)).to(device)
    check_close(int4_matmul(x, packed, None, TEST_THRESHOLDS), x, packed, None)


def test_uneven_groups_on_a_common_block():
    g_idx = torch.tensor([0] * 16 + [1] * 48 + [2] * 32)[torch.randperm(96, generator=torch.Generator().manual_seed(0))]
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (24, 96), generator=gen)
    scales, zeros = (torch.rand(24, 3, generator=gen) + 0.5).half().float(), torch.randint(0, 16, (24, 3), generator=gen)
    packed = pack_int4(codes, scales, zeros, g_idx.int())
    assert packed.group_size == 16 and packed.groups == 6
    ref = QuantizedWeight(codes, scales, zeros, g_idx.int(), QuantScheme(group_size=32)).dequantize()
    assert torch.equal(dequantize(packed), ref)
    if INTERPRET:
        x = torch.randn(3, 96, generator=gen)
        check_close(int4_matmul(x, packed, None, TEST_THRESHOLDS), x, packed, None)


def test_packing_round_trip_and_refusals():
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (9, 40), generator=gen)
    packed = pack_int4(codes, torch.ones(9, 1), torch.zeros(9, 1), torch.zeros(40, dtype=torch.int32))
    assert packed.qweight.shape == (5, 9) and packed.qweight.dtype == torch.int32
    assert torch.equal(unpack_codes(packed), codes.int())
    with pytest.raises(ValueError, match="0..15"):
        pack_int4(codes + 1, torch.ones(9, 1), torch.zeros(9, 1), torch.zeros(40, dtype=torch.int32))
    even_fours = (torch.arange(40) // 4).flip(0).int()  # sorted: ten even groups of 4, gathered per column
    assert pack_int4(codes, torch.ones(9, 10), torch.zeros(9, 10), even_fours).group_size == 4
    with pytest.raises(ValueError, match="uneven"):  # groups of 4 and 36 columns: the first block of 8 is split
        pack_int4(codes, torch.ones(9, 2), torch.zeros(9, 2), torch.tensor([0] * 4 + [1] * 36, dtype=torch.int32))


@pytest.mark.parametrize("device", DEVICES)
def test_batched_strided_and_empty_inputs(device):
    q = quantized(72, 128, 64, act_order=True, seed=3)
    packed = pack_int4(*(t.to(device) for t in (q.codes, q.scales, q.zeros, q.g_idx)))  # packed on the device
    assert packed.qweight.device.type == device
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(4)).to(device)[..., ::2]  # non-contiguous
    y = int4_matmul(x, packed, None, TEST_THRESHOLDS)
    assert y.shape == (2, 3, 72)
    check_close(y.reshape(6, 72), x.reshape(6, 128), packed, None)
    assert int4_matmul(x[:0], packed).shape == (0, 3, 72)
    with pytest.raises(ValueError, match="input features"):
        int4_matmul(x[..., :64], packed)


def checkpoint_weight(fmt: str, out_features: int, in_features: int, group_size: int, act_order: bool,
                      seed: int) -> QuantizedWeight:
    """A quantized weight written in `fmt`'s packed checkpoint layout and read back as the loader does."""
    from llmopt.core.quant_formats import pack_tensors, unpack_tensors

    q = quantized(out_features, in_features, group_size, act_order, seed)
    return unpack_tensors(fmt, pack_tensors(fmt, "p", q), "p", 4, group_size)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt,group_size,act_order", [("awq", 64, False), ("gptq", 32, True), ("gptq", -1, False)])
def test_linear_layer_matches_dequantized_weight(device, fmt, group_size, act_order):
    from llmopt.model.int4_linear import TritonInt4Linear, triton_int4_linear

    q = checkpoint_weight(fmt, 200, 128, group_size, act_order, seed=5)
    bias = torch.randn(200, generator=torch.Generator().manual_seed(6))
    layer = triton_int4_linear(q, bias)
    assert isinstance(layer, TritonInt4Linear) and (layer.perm is not None) == act_order
    layer = layer.to(device)
    packed = layer.packed()
    bias_bytes = 200 * 4
    assert layer.streamed_weight_bytes() == packed.nbytes() + bias_bytes
    # ~4.1-4.8 bits per weight against 16 for the fp16 dense weight
    assert layer.streamed_weight_bytes() < 200 * 128 * 2 / 3
    dense = q.dequantize()
    for rows in (1, 9, 40):
        x = torch.randn(2, rows, 128, generator=torch.Generator().manual_seed(rows)).to(device)
        want = x.cpu() @ dense.T + bias
        got = layer(x)
        assert got.shape == (2, rows, 200)
        assert (got.cpu() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_no_layer_without_triton(monkeypatch):
    import llmopt.model.int4_linear as int4_linear

    q = quantized(16, 64, 32, act_order=False, seed=7)
    monkeypatch.setattr(int4_linear, "triton_available", lambda: False)
    assert int4_linear.triton_int4_linear(q, None) is None


KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def test_kernels_import_nothing_from_llmopt_outside_kernels():
    # the Triton modules only: cpu_extension.py reads llmopt.core.embedded's cache folder
    for path in KERNELS.glob("triton_*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            for name in names:
                assert not name.startswith("llmopt") or name.startswith("llmopt.kernels"), (path.name, name)
    # and at run time, importing and calling the Triton module loads no other llmopt module
    code = ("import os, sys, torch;"
            "torch.cuda.is_available() or os.environ.setdefault('TRITON_INTERPRET', '1');"
            "from llmopt.kernels.triton_int4 import pack_int4, int4_matmul;"
            "p = pack_int4(torch.zeros(8, 32, dtype=torch.int32), torch.ones(8, 1), torch.zeros(8, 1),"
            "              torch.zeros(32, dtype=torch.int32));"
            "dev = 'cuda' if torch.cuda.is_available() else 'cpu';"
            "int4_matmul(torch.ones(1, 32, device=dev), p.to(dev));"
            "print(sorted(m for m in sys.modules if m.startswith('llmopt')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out) == ["llmopt", "llmopt.kernels", "llmopt.kernels.triton_int4", "llmopt.kernels.triton_int4_kernels"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,path", [(1, "gemv"), (5, "splitk")])
def test_split_k_sum_bias_and_cast_in_one_launch(monkeypatch, device, rows, path):
    """Split-K > 1: the tile's last program adds the partials, the bias and casts in the kernel; the
    arrival counters are back at zero afterwards (the next launch reuses them), and the same call
    gives the same bits (a fixed summation order)."""
    q = quantized(72, 256, 32, act_order=False, seed=rows)
    packed = pack_int4(q.codes, q.scales, q.zeros, q.g_idx).to(device)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=gen).to(device, torch.float16)
    bias = torch.randn(72, generator=gen).to(device, torch.float16)
    splits = []
    real_split_k = triton_int4_kernels._split_k
    monkeypatch.setattr(triton_int4_kernels, "_split_k", lambda *a: splits.append(real_split_k(*a)) or splits[-1])
    monkeypatch.setattr(torch.Tensor, "sum", lambda *a, **k: pytest.fail("a torch sum after the kernel"))
    got = triton_int4_kernels.fused_matmul(x, packed, bias, path)
    again = triton_int4_kernels.fused_matmul(x, packed, bias, path)
    monkeypatch.undo()
    assert splits[0] > 1
    assert got.dtype == torch.float16 and torch.equal(got, again)
    check_close(got, x, packed, bias)
    assert int(triton_int4_kernels._COUNTERS[x.device].abs().sum()) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path,tune", [("gemv", dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=2, num_warps=2)),
                                       ("splitk", dict(BLOCK_N=128, BLOCK_K=32, SPLIT_K=4))])
def test_tuned_configurations_compute_the_same_product(device, path, tune):
    """`fused_matmul`'s `tune` (what scripts/int4_sweep.py varies) changes tiles and splits, not results."""
    q = quantized(136, 256, 64, act_order=False, seed=11)
    packed = pack_int4(q.codes, q.scales, q.zeros, q.g_idx).to(device)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(3, 256, generator=gen).to(device, torch.float16)
    bias = torch.randn(136, generator=gen).to(device, torch.float16)
    check_close(triton_int4_kernels.fused_matmul(x, packed, bias, path, tune), x, packed, bias)
