"""int4 checkpoints load straight into the kernels' layouts: each AWQ / GPTQ (act-order) /
compressed-tensors W4A16 projection is repacked from the checkpoint's packed words a slab of
output rows at a time, on the CPU backend (llmopt's C++ layout) and on the Triton backend (its
interpreter on CPU), and no tensor of a projection's full [out, in] size is made on the way:
no dense weight, no code matrix. The layers hold the same bytes as the whole-matrix repacking
of the checkpoint's codes (what the loader built before), so the logits do not change."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from conftest import write_tiny_int4_checkpoints
from llmopt.core.quant_packing import awq_unpack, gptq_unpack, unpack_columns
from llmopt.core.quantized_weight import QuantizedWeight
from llmopt.core.weights import CheckpointReader
from llmopt.kernels import cpu_int4, triton_int4
from llmopt.kernels.triton_int4 import triton_available
from llmopt.loader import load
from llmopt.model.attention import EqualLengthAttention
from llmopt.model.backends import CpuBackend, TritonBackend
from llmopt.model.int4_linear import CpuInt4Linear, TritonInt4Linear
from llmopt.model.llama import checkpoint_names

CHECKPOINTS = {  # name: (quantize options, format of the packed tensors)
    "awq": dict(method="rtn", format="awq"),
    "gptq-act": dict(method="gptq", format="gptq", desc_act=True, sym=True),
    "compressed-tensors": dict(method="rtn", format="compressed-tensors"),
}
LAYERS = 3 * 4  # q/k/v, o, gate/up, down of the tiny models' 3 layers


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory) -> dict[str, Path]:
    return write_tiny_int4_checkpoints(tmp_path_factory.mktemp("int4direct"),
                                       {name: (tiny_models["llama"], kw) for name, kw in CHECKPOINTS.items()})


@pytest.fixture(params=["cpu", "triton"])
def backend(request, monkeypatch) -> str:
    """The kernel backend the model loads on: "cpu" (the C++ int4 layout) or "triton" (interpreted)."""
    if request.param == "triton":
        if not triton_available():
            pytest.skip("Triton is not installed")
        monkeypatch.setenv("LLMOPT_KERNELS", "triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return request.param


class _Allocations(TorchDispatchMode):
    """The (shape, dtype) of every tensor with storage an op makes while active (the decoder's
    skeleton is built on the meta device: its dense projections never hold memory)."""

    def __init__(self):
        super().__init__()
        self.made: list[tuple[tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made += [(tuple(t.shape), t.dtype) for t in tree_flatten(out)[0]
                      if isinstance(t, torch.Tensor) and t.device.type != "meta"]
        return out


def _projection_shapes(folder: Path) -> set[tuple[int, int]]:
    """[out, in] of every checkpoint projection and of every stacked projection (q/k/v, gate/up)."""
    config = load(str(folder), dtype="float32").config
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    return {(q, h), (kv, h), (h, q), (inter, h), (h, inter), (q + 2 * kv, h), (2 * inter, h)}


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_loading_makes_no_tensor_of_a_projections_size(checkpoints, backend, monkeypatch, name):
    """With slabs of one tile, no op of the load makes a floating tensor with as many elements as a
    projection has weights (a dense weight in any shape), nor a tensor of any dtype of a
    projection's [out, in] or [in, out] shape (its whole code matrix, as bytes or int32 words);
    every projection still becomes the backend's int4 layer."""
    folder = checkpoints[name]
    shapes = _projection_shapes(folder)
    sizes = {out * inp for out, inp in shapes}
    monkeypatch.setattr(cpu_int4, "SLAB_CODES", 1)
    monkeypatch.setattr(triton_int4, "SLAB_CODES", 1)
    with _Allocations() as allocations:
        model = load(str(folder), dtype="float32").model
    layer_type = CpuInt4Linear if backend == "cpu" else TritonInt4Linear
    assert sum(isinstance(m, layer_type) for m in model.modules()) == LAYERS
    assert allocations.made, "the dispatch mode saw no op"
    dense = [(s, d) for s, d in allocations.made if d.is_floating_point and math.prod(s) in sizes]
    whole_codes = [(s, d) for s, d in allocations.made if s in shapes or s[::-1] in shapes]
    assert not dense, dense[:5]
    assert not whole_codes, whole_codes[:5]


def _checkpoint_codes(reader: CheckpointReader, fmt: str, prefix: str) -> QuantizedWeight:
    """One projection's codes and grid unpacked whole, with the packing functions alone (what the
    loader handed the kernels before it read slabs)."""
    t = {k.removeprefix(prefix + "."): reader.get(k) for k in reader.names() if k.startswith(prefix + ".")}
    if fmt == "compressed-tensors":
        codes = unpack_columns(t["weight_packed"])
        out, groups = t["weight_scale"].shape
        zp = t.get("weight_zero_point")
        zeros = torch.full((out, groups), 8) if zp is None else unpack_columns(zp.t().contiguous()).t()[:out]
        scales = t["weight_scale"].float()
    else:
        codes, zeros = awq_unpack(t["qweight"], t["qzeros"]) if fmt == "awq" else gptq_unpack(t["qweight"], t["qzeros"])
        scales = t["scales"].float().t()
    width = codes.shape[1] // scales.shape[1]
    g_idx = t.get("g_idx", torch.arange(codes.shape[1]) // width)
    return QuantizedWeight(codes=codes, scales=scales.contiguous(), zeros=zeros.to(torch.int16).contiguous(),
                           g_idx=g_idx.to(torch.int32), scheme=None)


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_layers_hold_the_whole_matrix_layout_and_logits_do_not_change(checkpoints, backend, monkeypatch, name):
    """Each int4 layer loaded slab by slab (slabs of one tile) holds, buffer for buffer, the layout
    the backend makes from the checkpoint's whole code matrix; the logits equal those of the model
    loaded with whole-projection slabs bitwise, and the dense dequantized model's within the kernel's
    rounding (5% of the largest logit on the CPU kernel's int8 activations, 1e-5 on Triton's)."""
    folder, fmt = checkpoints[name], CHECKPOINTS[name]["format"]
    ids = torch.tensor([5, 17, 99, 3, 42, 7, 200, 64])

    def logits(model):
        with torch.inference_mode():
            return model.compute_logits(model(ids, torch.arange(len(ids)), EqualLengthAttention(1, len(ids)))).float()

    whole = load(str(folder), dtype="float32").model
    want = logits(whole)
    monkeypatch.setattr(cpu_int4, "SLAB_CODES", 1)
    monkeypatch.setattr(triton_int4, "SLAB_CODES", 1)
    model = load(str(folder), dtype="float32").model
    kernel_backend = CpuBackend() if backend == "cpu" else TritonBackend()
    reader = CheckpointReader.from_folder(folder)
    checked = 0
    for module_name, module in model.named_modules():
        if not isinstance(module, (CpuInt4Linear, TritonInt4Linear)):
            continue
        parts = [p.removesuffix(".weight") for p in checkpoint_names(f"{module_name}.weight")]
        qs = [_checkpoint_codes(reader, fmt, p) for p in parts]
        joined = QuantizedWeight(codes=torch.cat([q.codes for q in qs]), scales=torch.cat([q.scales for q in qs]),
                                 zeros=torch.cat([q.zeros for q in qs]), g_idx=qs[0].g_idx, scheme=None)
        direct = kernel_backend.int4_linear(joined, None, torch.float32)
        got, expected = dict(module.named_buffers()), dict(direct.named_buffers())
        assert got.keys() == expected.keys() and got
        for key in expected:
            assert torch.equal(got[key], expected[key]), (module_name, key)
        checked += 1
    assert checked == LAYERS
    assert torch.equal(logits(model), want)
    # the C++ kernel quantizes activations to int8 per 32 values (2.3% of the largest logit here);
    # the Triton kernel multiplies fp32 activations by the same weights as the dense model (7e-7)
    reference = logits(load(str(folder), dtype="float32", int4_kernels=False).model)
    tolerance = 0.05 if backend == "cpu" else 1e-5
    assert float((want - reference).abs().max()) <= tolerance * float(reference.abs().max())


@pytest.mark.parametrize("fmt", ["awq", "gptq", "compressed-tensors"])
def test_code_rows_of_stacked_parts_are_the_unpacked_codes(fmt):
    """Any slab of output rows (unaligned to the 8 codes of a word, across the parts of a stacked
    projection) is that slab of the whole unpacked code matrix."""
    from llmopt.core.compressed_tensors import CompressedTensorsScheme, read_int4_packed
    from llmopt.core.quant_formats import pack_tensors, read_packed
    from llmopt.core.quantized_weight import PackedQuantizedWeight, QuantScheme

    g = torch.Generator().manual_seed(0)
    parts, whole = [], []
    scheme = CompressedTensorsScheme("pack-quantized", 4, "int", "group", 32, False, None, None, ())
    for i, out in enumerate((24, 16, 40)):
        q = QuantizedWeight(codes=torch.randint(0, 16, (out, 64), generator=g, dtype=torch.uint8),
                            scales=torch.rand(out, 2, generator=g), zeros=torch.randint(1, 16, (out, 2), generator=g),
                            g_idx=torch.arange(64, dtype=torch.int32) // 32, scheme=QuantScheme(4, 32))
        t = pack_tensors(fmt, f"p{i}", q)
        parts.append(read_int4_packed(t, f"p{i}", scheme) if fmt == "compressed-tensors"
                     else read_packed(fmt, t, f"p{i}", 4, 32))
        whole.append(q.codes)
    stacked, codes = PackedQuantizedWeight.stacked(parts), torch.cat(whole)
    assert stacked.shape == (80, 64) and torch.equal(stacked.unpacked().codes, codes)
    for start, stop in ((0, 80), (5, 37), (23, 25), (40, 41), (63, 80)):
        assert torch.equal(stacked.code_rows(start, stop), codes[start:stop]), (start, stop)


def test_malformed_packed_tensors_are_one_clear_error():
    from llmopt.core.quant_formats import read_packed
    from llmopt.errors import LlmoptError

    tensors = {"p.qweight": torch.zeros(64, dtype=torch.int32), "p.qzeros": torch.zeros(2, 1, dtype=torch.int32),
               "p.scales": torch.ones(2, 8, dtype=torch.float16)}
    with pytest.raises(LlmoptError, match="p: packed tensors do not fit together"):
        read_packed("gptq", tensors, "p", 4, 32)
