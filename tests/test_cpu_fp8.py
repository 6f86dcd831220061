"""The C++ FP8 linear kernel (`kernels/csrc/fp8_linear.cpp`) against the PyTorch reference: every
e4m3 code widened exactly (subnormals included; the NaN patterns to a finite value, never a
crash), rows 1..97, odd widths (every k tail of the 32-, 16- and 8-code steps), batch
invariance, each SIMD path this build and CPU have (scalar table, AVX2 + F16C, AVX-512; capped
with `set_cpu_isa`, the others skipped with the reason), the paths against each other, and the
layer the loader builds from a checkpoint."""

from __future__ import annotations

import pytest
import torch

from llmopt.core.fp8_weight import FP8_DTYPE, quantize_fp8
from llmopt.kernels.cpu_extension import cpu_ops
from llmopt.kernels.cpu_fp8 import fp8_linear_kernel, reference_fp8_linear

ops = cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="llmopt's CPU kernels could not be built here")

PATHS = ["scalar", "avx2", "avx512"]  # fp8_linear's paths, narrowest first ("amx" takes the avx512 one)
NEEDS = {"avx2": "AVX2 + FMA + F16C", "avx512": "AVX-512 F/BW/VL/VNNI (csrc/isa.h's avx512 level) + F16C"}


def _path_under(cap: str) -> str:
    previous = ops.set_cpu_isa(cap)
    try:
        return ops.fp8_linear_path()
    finally:
        ops.set_cpu_isa(previous)


def paths_here() -> list[str]:
    """The kernel's paths this build and CPU take when capped at each level."""
    return [] if ops is None else [p for p in PATHS if _path_under(p) == p]


@pytest.fixture(params=PATHS)
def path(request):
    if request.param not in paths_here():
        pytest.skip(f"fp8_linear's {request.param} path needs {NEEDS[request.param]} in the build and the CPU "
                    f"(this one reaches {ops.cpu_isa_supported()})")
    previous = ops.set_cpu_isa(request.param)
    assert ops.fp8_linear_path() == request.param
    yield request.param
    ops.set_cpu_isa(previous)


def _weight(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return quantize_fp8(torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g))


def _code_values(codes: torch.Tensor) -> torch.Tensor:
    """float(code) for e4m3 bytes, the NaN patterns 0x7F / 0xFF as the kernel reads them (+-480:
    their bits as an fp16 of code / 256)."""
    values = codes.view(FP8_DTYPE).float()
    nan = (codes & 0x7F) == 0x7F
    return torch.where(nan, torch.where(codes >= 0x80, -480.0, 480.0), values)


def test_every_code_widens_exactly(path):
    # 256 codes at several positions of the 32-/16-/8-code steps and the scalar tail (K = 256 + 37)
    codes = torch.cat([torch.arange(256, dtype=torch.uint8), torch.arange(0, 256, 7, dtype=torch.uint8)])
    w = torch.stack([codes, codes.roll(5), codes.roll(19)])  # [3, 293]
    scales = torch.tensor([1.0, 0.5, 3.0e-3])
    x = torch.eye(w.shape[1])  # one weight per output element: no rounding in the sum
    out = fp8_linear_kernel()(x, w.contiguous(), scales, None)
    expected = (_code_values(w) * scales[:, None]).t()
    assert torch.isfinite(out).all()
    assert torch.equal(out, expected)
    subnormal = codes[(codes & 0x78) == 0]  # exponent 0: zero and m * 2^-9
    sub = fp8_linear_kernel()(torch.eye(subnormal.numel()), subnormal[None].contiguous(), torch.ones(1), None)
    assert torch.equal(sub[:, 0], subnormal.view(FP8_DTYPE).float())


@pytest.mark.parametrize("n,k", [(1, 1), (5, 7), (33, 13), (17, 97), (7, 48), (13, 31), (64, 576), (41, 579)])
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
    for lo, hi in ((3, 9), (0, 8), (5, 7), (2, 5)):  # tiles of 4, 2 and 1 rows at other offsets
        assert torch.equal(kernel(x[lo:hi].contiguous(), codes, q.scales, None), batch[lo:hi]), (lo, hi)


def test_nan_codes_do_not_crash_and_zero_rows(path):
    codes = torch.full((9, 40), 0x7F, dtype=torch.uint8)
    codes[::2] = 0xFF
    out = fp8_linear_kernel()(torch.ones(3, 40), codes, torch.ones(9), None)
    assert torch.equal(out, _code_values(codes).sum(1).expand(3, 9))
    assert fp8_linear_kernel()(torch.empty(0, 40), codes, torch.ones(9), None).shape == (0, 9)


@pytest.mark.skipif(len(paths_here()) < 2, reason="one fp8_linear path on this CPU: nothing to compare")
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_paths_agree(rows):
    """The paths group their sums differently (16 lanes, 8, one): equal within fp32 rounding."""
    q = _weight(960, 576, seed=3)
    codes = q.codes.view(torch.uint8)
    x = torch.randn(rows, 576)
    outs = {}
    for p in paths_here():
        previous = ops.set_cpu_isa(p)
        try:
            outs[p] = fp8_linear_kernel()(x, codes, q.scales, None)
        finally:
            ops.set_cpu_isa(previous)
    for p, out in outs.items():
        torch.testing.assert_close(out, outs["scalar"], rtol=1e-5, atol=1e-4, msg=p)


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
