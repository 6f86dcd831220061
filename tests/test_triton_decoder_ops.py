"""The Triton decoder ops (`llmopt.kernels.triton_decoder_ops`) against the PyTorch reference ops
(`llmopt.model.ops`), and the Triton backend's greedy tokens with them against the reference backend's.

Without CUDA the kernels run on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1, set before
Triton is imported); with CUDA the same tests run on the GPU.

Tolerances (eps: the dtype's machine epsilon, 2^-23 / 2^-10 / 2^-7 for fp32 / fp16 / bf16):
- RMSNorm: the kernel rounds where the reference does (normalized x to x's dtype, then times
  weight); only the sum of squares' order differs, which may move a rounding by one unit:
  |got - want| <= 2 eps |want| + 1e-6, and in fp16 / bf16 at most 1% of the elements differ at all.
  The residual sum (residual + x) is rounded once in both: equal.
- silu * up: silu rounded to the dtype, then times up, as the reference; exp may differ in its last
  bit: 2 eps |want| + 1e-6, in fp16 / bf16 at most 1% of the elements differing.
- rotary: the kernel computes x1 cos - x2 sin in fp32 and rounds once; the reference rounds
  both products and the sum: |got - want| <= eps (|x cos| + |rotate_half(x) sin| + |want|).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported
pytest.importorskip("triton")

from llmopt.kernels import triton_decoder_ops as k  # noqa: E402
from llmopt.model import ops as ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU tensors need TRITON_INTERPRET=1")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def _assert_within_ulps(got: torch.Tensor, want: torch.Tensor, ulps: float = 2.0) -> None:
    """Within `ulps` units of want; in fp16 / bf16 also equal but for <= 1% of the elements (the
    kernel rounds where the reference does: skipping one of those roundings changes ~25%)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.double(), want.double()
    bound = ulps * _eps(want.dtype) * w.abs() + 1e-6
    worst = ((g - w).abs() - bound).max().item()
    assert worst <= 0, f"{(g - w).abs().max().item()} over the bound somewhere (by {worst})"
    if want.dtype != torch.float32:
        assert (got != want).float().mean().item() <= 0.01


def _randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype).to(DEVICE)


# odd widths exercise the mask; 8216 > NORM_MAX_BLOCK takes the two-pass loop
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (5, 67), (3, 4096), (2, 3, 200), (3, k.NORM_MAX_BLOCK + 24)])
def test_rms_norm_and_add_rms_norm_match_the_reference(dtype, shape):
    hidden = shape[-1]
    x = _randn(*shape, dtype=dtype, seed=1, scale=3.0)
    residual = _randn(*shape, dtype=dtype, seed=2)
    weight = (_randn(hidden, dtype=torch.float32, seed=3).abs() + 0.5).to(dtype)
    _assert_within_ulps(k.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5))
    got, got_sum = k.add_rms_norm(x, residual, weight, 1e-6)
    want, want_sum = ref.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(got_sum, want_sum)
    _assert_within_ulps(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_reads_strided_rows_and_promotes_like_the_reference(dtype):
    wide = _randn(6, 150, dtype=dtype, seed=4)
    x, residual = wide[:, 7:107], wide[:, 40:140]  # row stride 150: views, not copies
    weight = _randn(100, dtype=dtype, seed=5)
    _assert_within_ulps(k.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6))
    got, got_sum = k.add_rms_norm(x, residual, weight, 1e-6)
    want, want_sum = ref.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(got_sum, want_sum)
    _assert_within_ulps(got, want)
    # an fp32 weight on 16-bit rows: the reference's `weight * x` is fp32
    fp32_weight = weight.float()
    _assert_within_ulps(k.rms_norm(x, fp32_weight, 1e-6), ref.rms_norm(x, fp32_weight, 1e-6))
    assert k.rms_norm(wide[:0], _randn(150, dtype=dtype, seed=13), 1e-6).shape == (0, 150)  # no rows: no launch


def _rotary_bound(x, cos, sin, want):
    x, cos, sin = x.double(), cos.double()[:, None, :], sin.double()[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return _eps(want.dtype) * ((x * cos).abs() + (rotated * sin).abs() + want.double().abs())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (8, 2, 64), (32, 8, 128), (5, 1, 80)])
def test_rotary_on_views_of_the_fused_qkv_output(dtype, heads, kv_heads, head_dim):
    """q and k are strided views of one [tokens, (heads + 2 kv_heads) * head_dim] matmul output, as in
    `Attention.forward`; cos / sin are random rows (the kernel must not assume equal halves)."""
    tokens = 3
    qkv = _randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=6, scale=2.0)
    q, kk, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, kk = q.view(tokens, heads, head_dim), kk.view(tokens, kv_heads, head_dim)
    cos, sin = _randn(tokens, head_dim, dtype=dtype, seed=7), _randn(tokens, head_dim, dtype=dtype, seed=8)
    before = qkv.clone()
    got_q, got_k = k.rotary(q, kk, cos, sin)
    want_q, want_k = ref.rotary(q, kk, cos, sin)
    assert torch.equal(qkv, before)  # the inputs are left alone, as the reference leaves them
    for got, want, x in ((got_q, want_q, q), (got_k, want_k, kk)):
        assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
        excess = (got.double() - want.double()).abs() - _rotary_bound(x, cos, sin, want)
        assert excess.max().item() <= 0, (got.double() - want.double()).abs().max().item()


def test_rotary_with_the_models_cos_sin():
    from llmopt.core.config import ModelConfig
    from llmopt.model.rope import RotaryEmbedding

    config = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 8,
                                  "hidden_size": 512, "intermediate_size": 8, "num_hidden_layers": 1,
                                  "num_attention_heads": 4, "num_key_value_heads": 1}, where="test")
    positions = torch.tensor([0, 1, 17, 255], device=DEVICE)
    cos, sin = RotaryEmbedding(config).to(DEVICE)(positions, torch.float32)
    q, kk = _randn(4, 4, 128, dtype=torch.float32, seed=9), _randn(4, 1, 128, dtype=torch.float32, seed=10)
    for got, want, x in zip(k.rotary(q, kk, cos, sin), ref.rotary(q, kk, cos, sin), (q, kk)):
        excess = (got.double() - want.double()).abs() - _rotary_bound(x, cos, sin, want)
        assert excess.max().item() <= 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 128), (4, 2 * 100), (2, 2 * 3000), (2, 3, 2 * 33)])
def test_silu_and_mul_matches_the_reference(dtype, shape):
    gate_up = _randn(*shape, dtype=dtype, seed=11, scale=4.0)
    _assert_within_ulps(k.silu_and_mul(gate_up), ref.silu_and_mul(gate_up))
    strided = _randn(3, shape[-1] + 10, dtype=dtype, seed=12, scale=4.0)[:, 5:5 + shape[-1]]
    _assert_within_ulps(k.silu_and_mul(strided), ref.silu_and_mul(strided))


def test_bad_shapes_are_refused():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="odd"):
        k.silu_and_mul(torch.zeros(2, 7, device=DEVICE))
    with pytest.raises(ValueError, match="residual"):
        k.add_rms_norm(x, x.half(), torch.ones(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="head_dim"):
        k.rotary(torch.zeros(2, 1, 7, device=DEVICE), torch.zeros(2, 1, 7, device=DEVICE),
                 torch.zeros(2, 7, device=DEVICE), torch.zeros(2, 7, device=DEVICE))


def test_triton_backend_runs_these_kernels_with_the_references_greedy_tokens(tiny_models, monkeypatch):
    """A tiny qwen2 (attention biases, tied embeddings) on the Triton backend: every norm, rope and
    silu*up is the Triton kernel, and its greedy tokens are the reference backend's up to the
    reference's first near tie (tests/test_triton_runtime.py)."""
    from test_runtime_exactness import tiny_prompts
    from test_triton_runtime import CONFIGS, assert_same_up_to_near_ties, greedy, load_on

    triton_model = load_on("triton", tiny_models["qwen2"], monkeypatch)
    reference_model = load_on("reference", tiny_models["qwen2"], monkeypatch)
    ops = triton_model.model.ops
    assert (ops.rms_norm, ops.add_rms_norm, ops.rotary, ops.silu_and_mul) == \
           (k.rms_norm, k.add_rms_norm, k.rotary, k.silu_and_mul)
    assert {m.ops for m in triton_model.model.modules() if hasattr(m, "ops")} == {ops}
    assert reference_model.model.ops is ref.REFERENCE_OPS
    prompts = tiny_prompts(4, seed=5)
    want, _ = greedy(reference_model, prompts, **CONFIGS["prefix-caching"])
    got, _ = greedy(triton_model, prompts, **CONFIGS["prefix-caching"])
    assert_same_up_to_near_ties(got, want)
