"""Int4 layouts against hand-built expectations written straight from the published formats.

The expectations below are plain Python loops over integers, independent of
llmopt.core.quant_packing, so a mistake in the packer cannot hide in its own inverse.
"""

from __future__ import annotations

import random

import torch

from llmopt.core.quant_formats import pack_tensors, unpack_tensors
from llmopt.core.quant_packing import (NATURAL_ORDER, awq_pack, awq_unpack, gptq_pack, gptq_unpack, pack_columns, pack_rows,
                                       unpack_columns)
from llmopt.quant.quantizer import QuantizedWeight, QuantScheme

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's GEMM order: nibble i holds output column ORDER[i]


def as_int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def hand_awq(codes: list[list[int]]) -> list[list[int]]:
    """codes[out][in] -> qweight[in][out/8] per AutoAWQ's pack: word j of row i = sum codes[8j+ORDER[k]][i] << 4k."""
    out_f, in_f = len(codes), len(codes[0])
    return [[as_int32(sum(codes[8 * j + AWQ_ORDER[k]][i] << (4 * k) for k in range(8))) for j in range(out_f // 8)]
            for i in range(in_f)]


def hand_gptq(codes: list[list[int]]) -> list[list[int]]:
    """codes[out][in] -> qweight[in/8][out]: word r of column o = sum codes[o][8r+k] << 4k."""
    out_f, in_f = len(codes), len(codes[0])
    return [[as_int32(sum(codes[o][8 * r + k] << (4 * k) for k in range(8))) for o in range(out_f)] for r in range(in_f // 8)]


def test_awq_word_layout_literal():
    # one row of eight output channels holding 0..7: nibbles (low to high) are 0,2,4,6,1,3,5,7
    codes = torch.arange(8).reshape(8, 1).expand(8, 8).contiguous()  # codes[out][in] = out
    qweight, _ = awq_pack(codes, torch.ones(8, 1, dtype=torch.long))
    assert qweight.shape == (8, 1) and qweight.dtype == torch.int32
    assert all((int(w) & 0xFFFFFFFF) == 0x75316420 for w in qweight[:, 0])


def test_gptq_word_layout_literal():
    # eight output channels; channel o has inputs 15, 14, ..., 8 and zero point o + 1
    codes = torch.tensor([[15, 14, 13, 12, 11, 10, 9, 8]]).expand(8, 8)
    qweight, qzeros = gptq_pack(codes, torch.arange(1, 9).reshape(8, 1))
    assert all(int(w) & 0xFFFFFFFF == 0x89ABCDEF for w in qweight[0])  # inputs packed along the word, natural order
    assert int(qzeros[0, 0]) & 0xFFFFFFFF == 0x76543210  # v1 stores zero - 1, channels in natural order


def test_awq_and_gptq_layouts_match_hand_built():
    rng = random.Random(0)
    out_f, in_f, groups = 16, 32, 2
    codes = [[rng.randrange(16) for _ in range(in_f)] for _ in range(out_f)]
    zeros = [[rng.randrange(1, 16) for _ in range(groups)] for _ in range(out_f)]
    t_codes, t_zeros = torch.tensor(codes), torch.tensor(zeros)

    qweight, qzeros = awq_pack(t_codes, t_zeros)
    assert qweight.tolist() == hand_awq(codes)
    zeros_in_major = [[zeros[o][g] for g in range(groups)] for o in range(out_f)]
    assert qzeros.tolist() == [row[:] for row in hand_awq(zeros_in_major)]
    back_codes, back_zeros = awq_unpack(qweight, qzeros)
    assert back_codes.tolist() == codes and back_zeros.tolist() == zeros

    qweight, qzeros = gptq_pack(t_codes, t_zeros)
    assert qweight.tolist() == hand_gptq(codes)
    expected_qzeros = [[as_int32(sum((zeros[8 * j + k][g] - 1) << (4 * k) for k in range(8))) for j in range(out_f // 8)]
                       for g in range(groups)]
    assert qzeros.tolist() == expected_qzeros
    back_codes, back_zeros = gptq_unpack(qweight, qzeros)
    assert back_codes.tolist() == codes and back_zeros.tolist() == zeros


def test_gptq_checkpoint_dequantizes_per_published_formula():
    """w[i, o] = scales[g_idx[i], o] * (nibble(qweight[i//8, o], i%8) - (nibble(qzeros[g, o//8], o%8) + 1))."""
    torch.manual_seed(0)
    out_f, in_f, width = 16, 64, 16
    g_idx = torch.randperm(in_f) // width  # act-order style: groups scattered over the columns
    q = QuantizedWeight(codes=torch.randint(0, 16, (out_f, in_f)), scales=torch.rand(out_f, in_f // width).half().float(),
                        zeros=torch.randint(1, 16, (out_f, in_f // width)), g_idx=g_idx.to(torch.int32),
                        scheme=QuantScheme(bits=4, group_size=width))
    t = pack_tensors("gptq", "m", q)
    qw, qz, sc, gi = t["m.qweight"].tolist(), t["m.qzeros"].tolist(), t["m.scales"].float(), t["m.g_idx"].tolist()
    expected = torch.empty(out_f, in_f)
    for i in range(in_f):
        for o in range(out_f):
            code = (qw[i // 8][o] >> (4 * (i % 8))) & 0xF
            zero = ((qz[gi[i]][o // 8] >> (4 * (o % 8))) & 0xF) + 1
            expected[o, i] = sc[gi[i], o] * (code - zero)
    loaded = unpack_tensors("gptq", t, "m", bits=4, group_size=width).dequantize()
    assert torch.equal(loaded, expected)
    assert torch.equal(loaded, q.dequantize())


def test_awq_checkpoint_dequantizes_per_published_formula():
    """AWQ: w[o, i] = scales[i//G, o] * (code - zero), codes/zeros at nibble ORDER^-1 of column o%8."""
    torch.manual_seed(1)
    out_f, in_f, width = 16, 64, 32
    q = QuantizedWeight(codes=torch.randint(0, 16, (out_f, in_f)), scales=torch.rand(out_f, in_f // width).half().float(),
                        zeros=torch.randint(0, 16, (out_f, in_f // width)), g_idx=(torch.arange(in_f) // width).to(torch.int32),
                        scheme=QuantScheme(bits=4, group_size=width))
    t = pack_tensors("awq", "m", q)
    qw, qz, sc = t["m.qweight"].tolist(), t["m.qzeros"].tolist(), t["m.scales"].float()
    expected = torch.empty(out_f, in_f)
    for o in range(out_f):
        nibble = AWQ_ORDER.index(o % 8)
        for i in range(in_f):
            code = (qw[i][o // 8] >> (4 * nibble)) & 0xF
            zero = (qz[i // width][o // 8] >> (4 * nibble)) & 0xF
            expected[o, i] = sc[i // width, o] * (code - zero)
    assert torch.equal(unpack_tensors("awq", t, "m", bits=4, group_size=width).dequantize(), expected)


def test_packing_stays_on_the_codes_device():
    """Quantizing on a GPU packs CUDA codes: every temporary on the codes' device (the first GPU run failed with
    "found at least two devices" here). Meta tensors stand in for CUDA: a CPU temporary breaks them the same way."""
    codes = torch.randint(0, 16, (16, 64), device="meta")
    for order in (NATURAL_ORDER, tuple(AWQ_ORDER)):
        packed = pack_columns(codes, order)
        assert packed.device.type == "meta" and unpack_columns(packed, order).device.type == "meta"
    assert pack_rows(codes).device.type == "meta"
