"""The C++ skinny linear kernel against a float64 reference on each SIMD path this CPU has, the bf16
path of prompt-sized products, and how DenseLinear dispatches to them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmopt.errors import LlmoptError
from llmopt.kernels import cpu_linear
from llmopt.kernels.cpu_extension import cpu_ops
from llmopt.kernels.cpu_prefill_attention import bf16_prompt_attention
from llmopt.kernels.cpu_linear import (BF16_MATH, BF16_TENSORS, SKINNY_MAX_ROWS, _onednn_bf16, bf16_linear, bf16_way,
                                      prefill_kernel, skinny_linear_kernel, uses_bf16)
from llmopt.model.backends import CpuBackend, ReferenceBackend
from llmopt.kernels.paged_attention import PROMPT_MATH_MIN_QUERIES, attend, causal_mask
from llmopt.model.linear import DenseLinear
from llmopt.model.llama import Attention
from llmopt.runtime.config import EngineConfig

kernel = skinny_linear_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="the CPU kernels could not be built here (or no AVX2/FMA)")
ISA_RANK = {"scalar": 0, "avx2": 1, "avx512": 2, "amx": 3}
needs_onednn_bf16 = pytest.mark.skipif(not _onednn_bf16(), reason="oneDNN has no bf16 path on this CPU (no AVX-512)")


@pytest.fixture(params=["avx2", "avx512"])
def isa(request):
    """Each SIMD path the build and this CPU have, forced in turn (`set_cpu_isa`); the others skip."""
    ops = cpu_ops()
    supported = ops.cpu_isa_supported()
    if ISA_RANK[supported] < ISA_RANK[request.param]:
        pytest.skip(f"this CPU and build allow the {supported} path, not {request.param}")
    previous = ops.set_cpu_isa(request.param)
    try:
        yield request.param
    finally:
        ops.set_cpu_isa(previous)


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if bias is None else bias.double())


@pytest.mark.parametrize("rows,n_in,n_out", [
    *[(rows, n_in, n_out) for rows in (1, 2, 3, 5, 7, 32, 96) for n_in, n_out in ((576, 960), (1536, 576), (37, 13), (8, 1))],
    (1, 576, 49152), (5, 576, 49152),  # the vocabulary projection: 8-row (batch 1) and 4 + 1 row tiles
])
def test_matches_float64_reference(rows, n_in, n_out, isa):
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


def test_a_rows_result_does_not_depend_on_the_other_rows(isa):
    """Bitwise, on each path: one sequence's logits are the same whatever else is in the decode batch."""
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


def test_dense_linear_uses_the_kernel_for_few_rows_only(monkeypatch):
    monkeypatch.setenv("LLMOPT_CPU_GEMM", "mkl")
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


def test_fp32_gemm_is_onednn_on_amd_and_forced_by_the_environment(monkeypatch):
    monkeypatch.delenv("LLMOPT_CPU_GEMM", raising=False)
    onednn_here = torch.backends.mkldnn.is_available()
    assert cpu_linear.fp32_gemm() == ("onednn" if cpu_linear._cpu_vendor() == "AuthenticAMD" and onednn_here else "mkl")
    monkeypatch.setenv("LLMOPT_CPU_GEMM", "mkl")
    assert cpu_linear.fp32_gemm() == "mkl"
    monkeypatch.setenv("LLMOPT_CPU_GEMM", "onednn")
    assert cpu_linear.fp32_gemm() == ("onednn" if onednn_here else "mkl")
    monkeypatch.setenv("LLMOPT_CPU_GEMM", "blis")  # not one of FP32_GEMMS: the CPU's default
    monkeypatch.setattr(cpu_linear, "_cpu_vendor", lambda: "GenuineIntel")
    assert cpu_linear.fp32_gemm() == "mkl"


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")
def test_dense_linear_prompt_rows_through_onednn_on_the_plain_weight(monkeypatch):
    """Where oneDNN is this CPU's fp32 GEMM, prompt-sized products take it on the weight itself (no
    copy: the storage is shared), in fp32: within fp32 rounding of the float64 product."""
    monkeypatch.setenv("LLMOPT_CPU_GEMM", "onednn")
    gen = torch.Generator().manual_seed(9)
    layer = DenseLinear(576, 200, bias=True)
    layer.weight.data = torch.randn(200, 576, generator=gen) * 576 ** -0.5
    layer.bias.data = torch.randn(200, generator=gen)
    layer.prepare(CpuBackend())
    assert layer.onednn_weight.data_ptr() == layer.weight.data_ptr()
    many = torch.randn(3, SKINNY_MAX_ROWS, 576, generator=gen)
    out = layer(many)
    assert out.shape == (3, SKINNY_MAX_ROWS, 200)
    assert torch.equal(out, cpu_linear.onednn_linear(many, layer.weight, layer.bias))
    ref = _reference(many.reshape(-1, 576), layer.weight, layer.bias)
    assert (out.reshape(-1, 200).double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item()
    with torch.no_grad():
        layer.weight.mul_(2)  # in-place changes (quantization's) reach the oneDNN product
    assert torch.allclose(layer(many) - layer.bias, 2 * (out - layer.bias), rtol=1e-5, atol=1e-5)
    few = torch.randn(4, 576, generator=gen)
    assert torch.equal(layer(few), kernel(few, layer.weight, layer.bias))  # decode steps: the skinny kernel
    monkeypatch.setenv("LLMOPT_CPU_GEMM", "mkl")
    layer.prepare(CpuBackend())
    assert layer.onednn_weight is None and torch.equal(layer(many), F.linear(many, layer.weight, layer.bias))


@pytest.mark.parametrize("rows", [1, 2, 7, 33, 130])
def test_bf16_weights_match_their_float64_product(rows, isa):
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


def test_auto_is_bf16_where_the_cpu_has_it_natively_and_the_isa_is_not_capped(fp32_matmul_auto_is_ieee, monkeypatch):
    native = fp32_matmul_auto_is_ieee  # the real check (the suite resolves auto to ieee)
    ops = cpu_ops()
    assert native() == (bf16_way() != "emulated" and _onednn_bf16() and ops.cpu_isa() not in ("scalar", "avx2"))
    previous = ops.set_cpu_isa("avx2")
    try:
        assert not native()  # LLMOPT_CPU_ISA=avx2: every product on the fp32 paths
    finally:
        ops.set_cpu_isa(previous)
    monkeypatch.setattr(cpu_linear, "native_bf16", native)
    assert uses_bf16("auto") == native()


def test_bf16_way_follows_the_cpu_flags(monkeypatch):
    for flags, way in (({"avx512_bf16", "amx_bf16"}, "amx"), ({"avx512f", "avx512_bf16"}, "avx512_bf16"),
                       ({"avx2", "fma"}, "emulated")):
        monkeypatch.setattr(cpu_linear, "_cpu_flags", lambda flags=flags: frozenset(flags))
        assert bf16_way() == way


@pytest.mark.parametrize("way", ["amx", "avx512_bf16", "emulated"])
def test_prefill_kernel_by_cpu_precision_and_rounding(way, monkeypatch):
    """AMX: the math mode (fp32 results) for auto and bf16; AVX512-BF16: bf16 tensors where a rounded
    result is allowed, else fp32 under auto (and the math mode, fp32 there, under an explicit bf16);
    no native bf16: only an explicit bf16 takes the math mode."""
    monkeypatch.setattr(cpu_linear, "bf16_way", lambda: way)
    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: way != "emulated")
    monkeypatch.setattr(cpu_linear, "_onednn_bf16", lambda: True)
    expected = {
        "amx": {("auto", True): BF16_MATH, ("auto", False): BF16_MATH, ("bf16", True): BF16_MATH,
                ("bf16", False): BF16_MATH},
        "avx512_bf16": {("auto", True): BF16_TENSORS, ("auto", False): None, ("bf16", True): BF16_TENSORS,
                        ("bf16", False): BF16_MATH},
        "emulated": {("auto", True): None, ("auto", False): None, ("bf16", True): BF16_MATH, ("bf16", False): BF16_MATH},
    }[way]
    for (precision, rounded), kernel_ in expected.items():
        assert prefill_kernel(precision, rounded) is kernel_, (precision, rounded)
        assert prefill_kernel("ieee", rounded) is None
    monkeypatch.setattr(cpu_linear, "_onednn_bf16", lambda: False)
    assert prefill_kernel("bf16") is None and prefill_kernel("auto") is None


@needs_onednn_bf16
@pytest.mark.parametrize("rows,n_in,n_out", [(97, 576, 960), (512, 1536, 576), (130, 37, 13)])
def test_bf16_tensors_are_the_rounded_product_of_bf16_rounded_inputs(rows, n_in, n_out):
    """oneDNN's bf16 GEMM: within a bf16 rounding of the result (2^-8 relative, plus the sums' fp32 error)
    of the float64 product of the rounded inputs, the bias added in fp32 after; and not the fp32 product.
    The packed copy a layer keeps gives the bits of bf16 tensors multiplied as they are."""
    gen = torch.Generator().manual_seed(rows + n_in)
    x = torch.randn(rows, n_in, generator=gen)
    w = torch.randn(n_out, n_in, generator=gen) * n_in ** -0.5
    b = torch.randn(n_out, generator=gen)
    got = BF16_TENSORS(x, w, b)
    assert got.dtype == torch.float32 and got.shape == (rows, n_out)
    assert torch.equal(got, F.linear(x.bfloat16(), w.bfloat16()).float() + b)
    copy = BF16_TENSORS.weight_copy(w)
    assert copy.is_mkldnn and copy.dtype == torch.bfloat16
    assert torch.equal(BF16_TENSORS.on_copy(x, copy, b), got)
    exact = _reference(x.bfloat16().float(), w.bfloat16().float(), None)
    err = (got.double() - b.double() - exact).abs()
    assert (err <= 2.0 ** -8 * exact.abs() + 1e-6 * exact.abs().max()).all()
    assert torch.equal(BF16_TENSORS(x, w), F.linear(x.bfloat16(), w.bfloat16()).float())
    assert (got.double() - _reference(x, w, b)).abs().max().item() > 1e-4


def test_fp32_matmul_precision_names():
    assert not uses_bf16("ieee")
    assert uses_bf16("bf16") == _onednn_bf16()
    with pytest.raises(ValueError, match="choose one of"):
        uses_bf16("tf32")
    with pytest.raises(LlmoptError, match="fp32_matmul_precision"):
        EngineConfig(fp32_matmul_precision="half")


@needs_onednn_bf16
@pytest.mark.parametrize("rows,n_in,n_out", [(97, 576, 960), (512, 1536, 576), (130, 37, 13)])
def test_bf16_linear_is_the_product_of_bf16_rounded_inputs(rows, n_in, n_out):
    """fp32 in and out, inputs rounded to bfloat16, sums in fp32 on AMX: as close to the float64 product of
    the rounded inputs as an fp32 GEMM is to its own (without AMX, on AVX512-BF16, oneDNN's results carry
    errors of bfloat16 size: within 2^-8 of the largest output there, measured 2^-9.4); and PyTorch's
    math mode is back to what it was."""
    gen = torch.Generator().manual_seed(rows + n_in)
    x = torch.randn(rows, n_in, generator=gen)
    w = torch.randn(n_out, n_in, generator=gen) * n_in ** -0.5
    b = torch.randn(n_out, generator=gen)
    before = torch.backends.mkldnn.matmul.fp32_precision
    got = bf16_linear(x, w, b)
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    assert got.dtype == torch.float32 and got.shape == (rows, n_out)
    ref = _reference(x.bfloat16().float(), w.bfloat16().float(), b)
    if bf16_way() == "amx":
        assert (got.double() - ref).abs().max().item() < 4e-7 * n_in ** 0.5 * ref.abs().max().item() + 1e-5
        # and it is not the fp32 product: the rounding of the inputs shows (without AMX, oneDNN keeps
        # small products such as 37 inputs on its fp32 kernels)
        assert (got.double() - _reference(x, w, b)).abs().max().item() > 1e-4
    else:
        assert (got.double() - ref).abs().max().item() < 2.0 ** -8 * ref.abs().max().item()


@needs_onednn_bf16
@pytest.mark.parametrize("prefill", [BF16_MATH, BF16_TENSORS], ids=["math_mode", "tensors"])
def test_dense_linear_takes_bf16_for_prompt_sized_rows_only(prefill):
    gen = torch.Generator().manual_seed(8)
    layer = DenseLinear(64, 48, bias=True)
    layer.weight.data = torch.randn(48, 64, generator=gen)
    layer.bias.data = torch.randn(48, generator=gen)
    layer.prepare(CpuBackend())
    assert CpuBackend().fp32_prefill_linear("bf16") is prefill_kernel("bf16")
    assert CpuBackend().fp32_prefill_linear("bf16", rounded_result=False) is prefill_kernel("bf16", False)
    assert CpuBackend().fp32_prefill_linear("ieee") is None and ReferenceBackend().fp32_prefill_linear("bf16") is None
    assert layer.use_prefill_kernel(prefill)
    few = torch.randn(SKINNY_MAX_ROWS, 64, generator=gen)
    many = torch.randn(2, SKINNY_MAX_ROWS, 64, generator=gen)  # any leading shape
    assert torch.equal(layer(few), kernel(few, layer.weight, layer.bias))  # decode steps stay fp32
    assert layer.prefill_weight is None  # a copy is made at the first prompt-sized call only
    out = layer(many)
    assert out.shape == (2, SKINNY_MAX_ROWS, 48)
    assert torch.equal(out.reshape(-1, 48), prefill(many.reshape(-1, 64), layer.weight, layer.bias))
    copy = layer.prefill_weight
    assert (copy is None) == (prefill.weight_copy is None)
    assert torch.equal(layer(many), out) and layer.prefill_weight is copy  # made once
    assert "prefill_weight" not in dict(layer.named_parameters()) and "prefill_weight" not in layer.state_dict()
    layer.weight.data = torch.randn(48, 64, generator=gen)  # a new weight: prepared, and the kernel taken, again
    layer.prepare(CpuBackend())
    assert layer.use_prefill_kernel(prefill) and layer.prefill_weight is None
    assert torch.equal(layer(many).reshape(-1, 48), prefill(many.reshape(-1, 64), layer.weight, layer.bias))
    assert not layer.use_prefill_kernel(None)
    assert torch.equal(layer(many), F.linear(many, layer.weight, layer.bias))
    layer.to(torch.float64)  # not an fp32 weight: never bf16
    assert not layer.use_prefill_kernel(prefill)
    layer.to(torch.float32)


@needs_onednn_bf16
def test_a_bf16_result_is_the_bf16_product_the_fp32_result_widens():
    gen = torch.Generator().manual_seed(9)
    layer = DenseLinear(64, 48)
    layer.weight.data = torch.randn(48, 64, generator=gen)
    layer.prepare(CpuBackend())
    many = torch.randn(SKINNY_MAX_ROWS + 3, 64, generator=gen)
    assert layer.use_prefill_kernel(BF16_TENSORS, bf16_result=True) and layer.prefill_bf16_result
    got = layer(many)
    assert got.dtype == torch.bfloat16 and torch.equal(got, F.linear(many.bfloat16(), layer.weight.bfloat16()))
    assert torch.equal(layer(many.bfloat16()), got)  # bf16 rows in: no second rounding
    assert layer(many[:SKINNY_MAX_ROWS]).dtype == torch.float32  # decode-sized rows stay fp32
    layer.use_prefill_kernel(BF16_TENSORS)
    assert torch.equal(layer(many), got.float())
    assert layer.use_prefill_kernel(BF16_MATH, bf16_result=True) and not layer.prefill_bf16_result  # fp32 results
    biased = DenseLinear(64, 48, bias=True)
    assert biased.use_prefill_kernel(BF16_TENSORS, bf16_result=True) and not biased.prefill_bf16_result


@needs_onednn_bf16
def test_bf16_products_handed_over_change_no_bit_of_the_model(tiny_models):
    """Where the decoder ops take bf16 into silu_and_mul and add_rms_norm, the engine's bf16 prompt products hand the
    gate_up, o_proj and down_proj products over in bf16 (the residual add widens down_proj's): the hidden states are
    bitwise those of widening them first. qkv's and the vocabulary projection's stay fp32."""
    from llmopt.loader import load
    from llmopt.model.attention import EqualLengthAttention

    loaded = load(str(tiny_models["llama"]), dtype="float32")
    model = loaded.model
    if not (model.ops.silu_and_mul_takes_bf16 and model.ops.add_rms_norm_takes_bf16
            and prefill_kernel("bf16") is BF16_TENSORS):
        pytest.skip("the decoder ops here do not take bf16, or this CPU's bf16 products are not bf16 tensors")
    assert model.use_fp32_matmul_precision("bf16")
    handed = [m for layer in model.model.layers
              for m in (layer.mlp.gate_up_proj, layer.mlp.down_proj, layer.self_attn.o_proj)]
    assert all(m.prefill_bf16_result for m in handed)
    assert not any(m.prefill_bf16_result for m in model.modules() if isinstance(m, DenseLinear) and m not in handed)
    ids = torch.randint(3, model.config.vocab_size, (2 * 150,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(150).repeat(2)
    bf16_hand_over = model(ids, positions, EqualLengthAttention(2, 150))
    for m in handed:
        m.prefill_bf16_result = False
    widened = model(ids, positions, EqualLengthAttention(2, 150))
    assert torch.equal(widened, bf16_hand_over)
    model.use_fp32_matmul_precision("ieee")
    assert not torch.equal(model(ids, positions, EqualLengthAttention(2, 150)), widened)  # the bf16 products ran


@needs_onednn_bf16
def test_the_engine_flag_reaches_every_dense_layer(tiny_models):
    from llmopt.loader import load
    from llmopt.runtime import LLM

    loaded = load(str(tiny_models["llama"]), dtype="float32")
    dense = [m for m in loaded.model.modules() if isinstance(m, DenseLinear)]
    assert dense and all(m.prefill is None for m in dense)  # a model loaded outside an engine: fp32
    attention = [m for m in loaded.model.modules() if isinstance(m, Attention)]
    LLM(loaded, num_kv_blocks=16, fp32_matmul_precision="bf16")
    # the vocabulary projection only takes a kernel whose result is not rounded to bf16
    assert all(m.prefill is prefill_kernel("bf16") for m in dense if m is not loaded.model.lm_head)
    assert loaded.model.lm_head.prefill is prefill_kernel("bf16", rounded_result=False) is not None
    attention_dtype = torch.bfloat16 if bf16_prompt_attention() else None
    assert attention and all(m.prompt_math_dtype == attention_dtype for m in attention)
    LLM(loaded, num_kv_blocks=16, fp32_matmul_precision="ieee")
    assert all(m.prefill is None for m in dense)
    assert all(m.prompt_math_dtype is None for m in attention)


@pytest.mark.parametrize("queries", [PROMPT_MATH_MIN_QUERIES - 1, PROMPT_MATH_MIN_QUERIES, 200])
@pytest.mark.parametrize("causal", [True, False])
def test_prompt_attention_math_dtype_applies_to_prompt_sized_chunks_only(queries, causal):
    """bf16 math: the fp32 result of SDPA over the bf16-rounded q/k/v (grouped heads), for chunks of
    PROMPT_MATH_MIN_QUERIES queries or more; below that, bitwise the fp32 attention."""
    g = torch.Generator().manual_seed(queries)
    context = 37
    q = torch.randn(queries, 6, 32, generator=g)
    k = torch.randn(context + queries, 2, 32, generator=g)
    v = torch.randn(context + queries, 2, 32, generator=g)
    mask, is_causal = causal_mask(queries, 0 if causal else context, None, q.device)
    if causal:
        k, v = k[context:], v[context:]
    fp32 = attend(q, k, v, mask, is_causal)
    got = attend(q, k, v, mask, is_causal, math_dtype=torch.bfloat16)
    assert got.dtype == torch.float32 and got.shape == q.shape
    if queries < PROMPT_MATH_MIN_QUERIES:
        assert torch.equal(got, fp32)
        return
    rounded = attend(q.bfloat16().double(), k.bfloat16().double(), v.bfloat16().double(), mask, is_causal)
    # bf16 inputs exactly; what is left is the kernel's bf16 probabilities and fp32 sums
    assert (got.double() - rounded).abs().max() < 2e-2
    assert (got - fp32).abs().max() > 1e-4  # it did compute in bf16 (fp32 would agree to ~1e-6)
