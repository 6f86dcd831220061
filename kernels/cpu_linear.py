"""fp32 `x @ w.T (+ bias)` on CPU: the C++ few-row kernel (`csrc/skinny_linear.cpp`), and the
bfloat16 path for prompt-sized row counts.

A decode step multiplies a handful of rows (one per running sequence) by every weight
matrix. MKL's GEMM, what `F.linear` runs, re-packs the weight on each call, and with few
rows that copy outweighs the arithmetic: on the default model a batch-4 step spent twice
as long in its linears as batch 1. The kernel reads each weight row once and dots it with
all rows of x while it is in L1 (`llmopt bench kernels --device cpu` measures both). Larger
inputs (prompt chunks, perplexity windows) keep MKL, which wins there, or take the bf16 path.

The bf16 paths (`prefill_kernel`), one of two by CPU (`bf16_way`). With AMX-BF16 tiles, `BF16_MATH` (`bf16_linear`):
oneDNN's matmul with fp32 inputs and outputs in its bf16 math mode (PyTorch's
`torch.backends.mkldnn.matmul.fp32_precision = "bf16"`): inputs rounded to bfloat16, products summed
and returned in fp32, several times faster than fp32 at prompt sizes. With AVX512-BF16 alone (AMD
Zen 4, Intel Cooper Lake) that mode runs oneDNN's fp32 kernel (bitwise `onednn_linear`, at its
speed, oneDNN 3.12), while oneDNN's bf16 GEMM on bf16 tensors (`vdpbf16ps`, fp32 sums) runs ~1.7x
fp32's rate there: so on those CPUs `BF16_TENSORS` rounds the inputs and the weight to bfloat16
for the call, and the result comes back rounded to bfloat16 too (what oneDNN returns), then widened. The roundings are
what it costs (relative error ~2^-9 per input, and per output without AMX; measured on the default
model in docs/benchmarks.md). A layer that keeps its weight runs the bf16 GEMM on a copy rounded and
packed once into oneDNN's own layout (`PrefillKernel.weight_copy`: half the fp32 weight's bytes beside it),
not on a weight rounded on every call: the same bits, without the per-call rounding (measured in docs/benchmarks.md).

Full-precision prompt products go through the faster of two fp32 GEMMs on this CPU (`fp32_gemm`):
MKL's, what `F.linear` runs, or oneDNN's (`onednn_linear`).
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from llmopt.kernels.cpu_extension import cpu_ops, log

# up to this many rows the kernel beats MKL on this project's shapes (`llmopt bench kernels --device cpu`)
SKINNY_MAX_ROWS = 96

# what `fp32_matmul_precision` accepts: float32 throughout, bf16 inputs, or bf16 where the CPU has it natively
FP32_MATMUL_PRECISIONS = ("auto", "ieee", "bf16")


def skinny_linear_kernel() -> Callable | None:
    """`skinny_linear(x [M, K], w [N, K], bias=None) -> [M, N]` (fp32, contiguous), or None
    where the CPU kernels cannot be built or the CPU lacks AVX2/FMA (then use `F.linear`)."""
    ops = cpu_ops()
    return ops.skinny_linear if ops is not None and ops.skinny_linear_available() else None


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively in a way oneDNN uses (`bf16_way`: AMX-BF16 tiles or
    AVX512-BF16) and the CPU kernels' SIMD path is not capped below AVX-512 (`LLMOPT_CPU_ISA=avx2`
    keeps every product on the AVX2-era fp32 paths). Without either, oneDNN emulates bf16 at about
    fp32's cost."""
    ops = cpu_ops()
    if ops is not None and ops.cpu_isa() in ("scalar", "avx2"):
        return False
    return bf16_way() != "emulated" and _onednn_bf16()


def bf16_way() -> str:
    """How this CPU multiplies bf16 for oneDNN: "amx" (AMX-BF16 tiles: `bf16_linear`), "avx512_bf16"
    (`vdpbf16ps` on bf16 tensors: `BF16_TENSORS`) or "emulated" (neither)."""
    flags = _cpu_flags()
    return "amx" if "amx_bf16" in flags else "avx512_bf16" if "avx512_bf16" in flags else "emulated"


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(next((line for line in info.splitlines() if line.startswith("flags")), "").split())


# Which library multiplies fp32 prompt-sized products at full precision: "mkl" (`F.linear`) or
# "onednn" (`torch.ops.mkldnn._linear_pointwise` on the plain weight, no copy); LLMOPT_CPU_GEMM
# forces one (tests run both). Measured side by side, 2 threads, the default model's projections at
# 2,048 rows (docs/benchmarks.md, scripts/bench_fp32_gemm.py): on AMD Zen 4 MKL's sgemm (its "zen"
# kernels, 141-151 GFLOP/s) takes 1.32x oneDNN's time (181-203 GFLOP/s, 80-90% of the FMA peak); on
# an Intel Xeon the two were level (MKL ahead on 2 of 3 shapes). Hence oneDNN on AMD CPUs, MKL elsewhere.
FP32_GEMMS = ("mkl", "onednn")


def fp32_gemm() -> str:
    """The library for fp32 prompt-sized products on this CPU (`FP32_GEMMS`): LLMOPT_CPU_GEMM when set,
    else "onednn" on AMD CPUs where oneDNN is available, "mkl" elsewhere."""
    requested = os.environ.get("LLMOPT_CPU_GEMM")
    if requested in FP32_GEMMS:
        return requested if requested == "mkl" or torch.backends.mkldnn.is_available() else "mkl"
    if requested:
        _warn_unknown_gemm(requested)
    return "onednn" if _cpu_vendor() == "AuthenticAMD" and torch.backends.mkldnn.is_available() else "mkl"


def onednn_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, bias)` in fp32 through oneDNN's matmul (the weight as it is: plain layout, no copy)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


@functools.cache
def _warn_unknown_gemm(requested: str) -> None:  # once per value: every fp32 layer asks at load
    log.warning("LLMOPT_CPU_GEMM=%s is not one of %s: ignored", requested, ", ".join(FP32_GEMMS))


@functools.cache
def _cpu_vendor() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((line for line in info.splitlines() if line.startswith("vendor_id")), "")
    return line.partition(":")[2].strip()


def _onednn_bf16() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@dataclass(frozen=True)
class PrefillKernel:
    """An fp32 prompt-sized product `kernel(x, w, bias) -> y`, in two parts for layers that keep their weight:
    `weight_copy(w)`, the copy the product reads (a layer makes it once; None: the product reads `w` itself),
    and `on_copy(x, copy, bias)`. Calling the kernel makes the copy for that call. `bf16_on_copy(x, copy)`, where
    the kernel's result is a bf16 rounding anyway: that bf16 product itself (no bias), not widened."""

    weight_copy: Callable[[torch.Tensor], torch.Tensor] | None
    on_copy: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    bf16_on_copy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.on_copy(x, w if self.weight_copy is None else self.weight_copy(w), bias)


def prefill_kernel(precision: str, rounded_result: bool = True) -> PrefillKernel | None:
    """The kernel for fp32 prompt-sized products under `precision` (FP32_MATMUL_PRECISIONS), or None for
    fp32 (`F.linear` / oneDNN's fp32 GEMM): "ieee" never; "auto" where the CPU multiplies bf16 natively
    (`native_bf16`); "bf16" wherever oneDNN has a bf16 path. AMX CPUs take `BF16_MATH`; AVX512-BF16 ones
    `BF16_TENSORS`, whose result is rounded to bf16, only where `rounded_result` allows it (the engine's
    forward does; quantization's Hessians and losses do not, and stay fp32 there under "auto", as under
    "bf16" on CPUs without native bf16, where oneDNN's bf16 mode computes in fp32)."""
    if precision not in FP32_MATMUL_PRECISIONS:
        raise ValueError(f"unknown fp32 matmul precision {precision!r}; choose one of: {', '.join(FP32_MATMUL_PRECISIONS)}")
    if precision == "ieee" or not _onednn_bf16() or (precision == "auto" and not native_bf16()):
        return None
    way = bf16_way()
    if way == "avx512_bf16" and rounded_result:
        return BF16_TENSORS
    return BF16_MATH if way != "avx512_bf16" or precision == "bf16" else None


def uses_bf16(precision: str) -> bool:
    """Whether the engine's fp32 prompt-sized products take bf16 under `precision` (`prefill_kernel`)."""
    return prefill_kernel(precision) is not None


# The bf16 math mode is a process-wide PyTorch setting, switched on only for the call; the lock keeps
# two callers from switching it off under each other. An fp32 matmul on another thread during the
# call would run in it too: the engine runs its model steps on one thread.
_mode_lock = threading.Lock()


def bf16_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, bias)` for fp32 CPU tensors in oneDNN's bf16 math mode: bf16-rounded inputs, fp32
    sums and result on AMX tiles (without AMX oneDNN runs its fp32 kernel)."""
    matmul = torch.backends.mkldnn.matmul
    with _mode_lock:
        previous = matmul.fp32_precision
        matmul.fp32_precision = "bf16"
        try:
            return F.linear(x, w, bias)
        finally:
            matmul.fp32_precision = previous


# the row count oneDNN picks the packed layout for: the eval's forwards and prompt chunks are up to ~2,048 rows
PACKED_FOR_ROWS = 2048


def bf16_weight_copy(w: torch.Tensor) -> torch.Tensor:
    """w rounded to bfloat16 and packed into the blocked layout oneDNN's GEMM reads (an opaque oneDNN tensor;
    the layout chosen for prompt-sized row counts, any count works)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().to(torch.bfloat16), PACKED_FOR_ROWS)


def bf16_product(x: torch.Tensor, w_bf16: torch.Tensor) -> torch.Tensor:
    """`x @ w.T` through oneDNN's bf16 GEMM on `w_bf16` (`bf16_weight_copy`, or any bf16 [N, K] tensor): x (fp32
    or bf16) rounded to bf16, fp32 sums, the product rounded to bf16."""
    return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), w_bf16, None, "none", [], "")


def linear_on_bf16_copy(x: torch.Tensor, w_bf16: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, bias)` for fp32 x as `bf16_product`, the product widened and the bias added in fp32."""
    out = bf16_product(x, w_bf16).float()
    return out if bias is None else out.add_(bias)


# oneDNN's bf16 math mode on the fp32 weight as it is (changes to the weight are seen)
BF16_MATH = PrefillKernel(None, bf16_linear)
# bf16 tensors through oneDNN's bf16 GEMM (AVX512-BF16 without AMX)
BF16_TENSORS = PrefillKernel(bf16_weight_copy, linear_on_bf16_copy, bf16_product)
