"""The Triton FP8 matmul (`llmopt.kernels.triton_fp8`) against its PyTorch reference, and its
kernels compiled for sm_80 / sm_89 / sm_90 without a GPU.

Without CUDA the kernels run in Triton's interpreter on CPU (TRITON_INTERPRET=1, set before
Triton is imported), fp32 and fp16 only (bf16 `tl.dot` is wrong in the interpreter). Checked:
every e4m3 code widened exactly by the upcast kernel's bit arithmetic; the upcast product
against the dequantized weight's (fp32: 1e-5 of the output's max |value|, summation order
only; fp16: 2e-3, the output's rounding); the per-row activation rounding of the native path
against PyTorch's e4m3 cast (equal values); the native product against the same W8A8 arithmetic in
PyTorch. The compile check runs `triton.compile` in a subprocess (the kernels must be decorated
without the interpreter) for each target: the upcast kernel for sm_80, 89 and 90; the e4m3
kernels for sm_89 (mma.sync e4m3) and sm_90 (wgmma e4m3 on 64-row tiles). And an FP8 checkpoint
on the Triton backend (`TritonFp8Linear`) generates the reference backend's greedy tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated: before the first import
pytest.importorskip("triton")

from llmopt.core.fp8_weight import FP8_DTYPE, quantize_fp8  # noqa: E402
from llmopt.kernels.triton_fp8 import fp8_matmul, quantize_rows_reference, reference_fp8_matmul  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not INTERPRET, reason="CPU tensors need TRITON_INTERPRET=1")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _weight(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = quantize_fp8(torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g))
    return q.codes.to(DEVICE), q.scales.to(DEVICE)


def _close(got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    err = (got.float() - ref.float()).abs().max().item()
    assert err <= tol * max(ref.float().abs().max().item(), 1e-6), err


def test_upcast_widens_every_code_exactly():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # e4m3fn's NaN patterns are never written
    w = codes[None].repeat(16, 1).contiguous().to(DEVICE)
    out = fp8_matmul(torch.eye(codes.numel(), device=DEVICE), w, torch.full((16,), 0.5, device=DEVICE), native=False)
    assert torch.equal(out[:, 0].cpu(), codes.view(FP8_DTYPE).float() * 0.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n,k", [(1, 72, 200), (3, 64, 576), (16, 130, 100), (17, 40, 64), (33, 96, 129)])
def test_upcast_matches_reference(dtype, rows, n, k):
    codes, scales = _weight(n, k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).to(DEVICE, dtype)
    bias = torch.randn(n).to(DEVICE)
    _close(fp8_matmul(x, codes, scales, bias, native=False), reference_fp8_matmul(x, codes, scales, bias), TOLERANCE[dtype])


def test_native_rounds_activations_as_pytorch_does():
    from llmopt.kernels.triton_fp8_kernels import quantize_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 300, generator=g) * torch.tensor([1.0, 1e-3, 50.0, 0.0, 1.0])[:, None]
    x[4, 7] = 1e4  # a row whose max dwarfs the rest: most of it rounds to e4m3 subnormals or zero
    q, s = quantize_rows(x.to(DEVICE))
    rq, rs = quantize_rows_reference(x)
    assert torch.equal(s.cpu(), rs)
    assert torch.equal(q.float().cpu(), rq.float())  # equal values (a zero's sign may differ: -0 rounds to +0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,n,k", [(1, 72, 200), (16, 130, 256), (33, 96, 129)])
def test_native_matches_w8a8_reference(dtype, rows, n, k):
    if DEVICE == "cuda":
        from llmopt.kernels.triton_fp8 import native_fp8_supported

        if not native_fp8_supported(torch.device("cuda")):
            pytest.skip("no fp8 tensor cores on this GPU (compute capability < 8.9)")
    codes, scales = _weight(n, k, seed=rows + 1)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n)).to(DEVICE, dtype)
    ref = reference_fp8_matmul(x, codes, scales, quantize_x=True)
    _close(fp8_matmul(x, codes, scales, native=True), ref, TOLERANCE[dtype])
    # and the W8A8 product stays near the weight-only one (e4m3 activations: ~2^-4 relative per value)
    _close(fp8_matmul(x, codes, scales, native=True), reference_fp8_matmul(x, codes, scales), 0.1)


def test_shapes_and_bad_input():
    codes, scales = _weight(8, 32, seed=9)
    x = torch.randn(2, 3, 32).to(DEVICE)
    assert fp8_matmul(x, codes, scales, native=False).shape == (2, 3, 8)
    assert fp8_matmul(x[:0], codes, scales, native=False).shape == (0, 3, 8)
    with pytest.raises(ValueError, match="input features"):
        fp8_matmul(torch.randn(2, 31).to(DEVICE), codes, scales)
    with pytest.raises(ValueError, match="activation dtype"):
        fp8_matmul(torch.zeros(2, 32, dtype=torch.int32).to(DEVICE), codes, scales)


COMPILE_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path[:0] = json.loads(os.environ["LLMOPT_TEST_SYS_PATH"])  # import llmopt.kernels as the test process does
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from llmopt.kernels import triton_fp8_kernels as K

    upcast = ({"x_ptr": "*fp16", "w_ptr": "*u8", "s_ptr": "*fp32", "bias_ptr": "*fp32", "out_ptr": "*fp16",
               "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_om": "i32", "HAS_BIAS": "constexpr",
               "INPUT_PRECISION": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
              {"HAS_BIAS": True, "INPUT_PRECISION": "tf32", "BLOCK_M": 16, "BLOCK_N": K.BLOCK_N,
               "BLOCK_K": K.UPCAST_BLOCK_K})
    quant = ({"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "K": "i32", "stride_xm": "i32",
              "FP8_MAX_": "constexpr", "MIN_SCALE_": "constexpr", "BLOCK_K": "constexpr"},
             {"FP8_MAX_": 448.0, "MIN_SCALE_": 1 / (448.0 * 512), "BLOCK_K": K.QUANT_BLOCK_K})
    native = ({"xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "bias_ptr": "*fp32",
               "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "stride_om": "i32", "HAS_BIAS": "constexpr",
               "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
              {"HAS_BIAS": False, "BLOCK_M": 64, "BLOCK_N": K.BLOCK_N, "BLOCK_K": K.NATIVE_BLOCK_K})
    jobs = [(cc, "upcast", K._upcast_kernel, upcast) for cc in (80, 89, 90)]
    jobs += [(cc, name, fn, spec) for cc in (89, 90)
             for name, fn, spec in (("quantize_rows", K._quantize_rows_kernel, quant), ("native", K._native_kernel, native))]
    out = []
    for cc, name, fn, (signature, constexprs) in jobs:
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                target=GPUTarget("cuda", cc, 32))
        mma = [line.strip().split()[0] for line in kernel.asm["ptx"].splitlines() if "mma" in line and "e4m3" in line]
        out.append({"cc": cc, "kernel": name, "cubin_bytes": len(kernel.asm["cubin"]), "e4m3_mma": sorted(set(mma))})
    print(json.dumps(out))
""")


@pytest.mark.skipif(sys.platform != "linux", reason="Triton's bundled ptxas is a Linux x86-64 binary")
def test_kernels_compile_for_sm80_sm89_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["LLMOPT_TEST_SYS_PATH"] = json.dumps([p for p in sys.path if p])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("Triton's bundled ptxas is missing here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {(r["cc"], r["kernel"]): r for r in json.loads(proc.stdout.strip().splitlines()[-1])}
    assert all(r["cubin_bytes"] > 0 for r in results.values())
    assert {cc for cc, _ in results} == {80, 89, 90}
    assert results[(89, "native")]["e4m3_mma"] == ["mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32"]
    assert any(m.startswith("wgmma.mma_async") for m in results[(90, "native")]["e4m3_mma"])
    assert results[(80, "upcast")]["e4m3_mma"] == []  # sm_80 has no fp8: the bit-arithmetic widening only


def test_fp8_checkpoint_on_triton_layers(tiny_models, monkeypatch, tmp_path):
    """An FP8_DYNAMIC checkpoint of the tiny model: the Triton backend swaps in `TritonFp8Linear`
    and its greedy tokens are those of the dense dequantized weights (the reference backend) up to
    near ties: the upcast kernel is weight-only, like the reference."""
    from llmopt.kernels.triton_fp8 import native_fp8_supported
    from llmopt.model.fp8_linear import TritonFp8Linear
    from llmopt.quant.quantize import QuantizeRequest, quantize
    from test_triton_runtime import CONFIGS, assert_same_up_to_near_ties, greedy, load_on, tiny_prompts

    if DEVICE == "cuda" and native_fp8_supported(torch.device("cuda")):
        pytest.skip("this GPU takes the native kernel, which rounds activations to e4m3: the kernel tests cover it")
    out = tmp_path / "fp8"
    quantize(QuantizeRequest(model=str(tiny_models["llama"]), output=out, method="fp8"))
    triton_model = load_on("triton", out, monkeypatch)
    reference_model = load_on("reference", out, monkeypatch)
    layers = len(triton_model.model.model.layers)
    assert sum(isinstance(m, TritonFp8Linear) for m in triton_model.model.modules()) == 4 * layers
    assert not any(isinstance(m, TritonFp8Linear) for m in reference_model.model.modules())
    prompts = tiny_prompts(3, seed=4)
    want, _ = greedy(reference_model, prompts, **CONFIGS["prefix-caching"])
    got, _ = greedy(triton_model, prompts, **CONFIGS["prefix-caching"])
    assert_same_up_to_near_ties(got, want)
