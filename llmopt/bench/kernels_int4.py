"""int4 matmul micro-benchmarks for `llmopt bench kernels`.

CUDA: the Triton int4 kernel (`llmopt.kernels.triton_int4`, the path it picks for M) against
fp16 `F.linear` (cuBLAS) on Llama-3-8B's projections, groups of 128, and GemLite where it is
installed. CPU: the C++ int4 kernel (`llmopt.kernels.cpu_int4`) against fp32 `F.linear`
(MKL, what transformers runs) and our skinny fp32 kernel (`cpu_linear`), on the default
model's (SmolLM2-135M) projections in groups of 64 (its 576 columns are not a multiple of
128); on its vocabulary projection also the int8 (Q8_0) and bf16 copies int4 models
multiply by there (`DenseLinear.use_compact_copy`).

Weights are random 4-bit codes with random scales and zero points (timing does not depend on
the values); every dense back end multiplies by the dequantized weight, so all rows compute
the same product. max |diff| is against that product in fp32 (CUDA) or fp64 (CPU); the C++
int4 and int8 kernels are checked against their own PyTorch references instead, since they
quantize the activations to int8 by design.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.nn.functional as F

from llmopt.bench.kernel_run import KernelRun, max_diff
from llmopt.bench.kernel_timing import CallTimer

# Llama-3-8B: hidden 4096, 32 q / 8 kv heads of 128 (qkv 4096 + 2 * 1024), intermediate 14336
LLAMA3_8B_SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
CUDA_GROUP_SIZE = 128
# SmolLM2-135M, the embedded default model: hidden 576, 9 q / 3 kv heads of 64, intermediate 1536
DEFAULT_MODEL_SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
                        "lm_head": (576, 49152)}
CPU_GROUP_SIZE = 64
KERNEL = "int4_matmul"


def random_int4(n_in: int, n_out: int, group_size: int, device: torch.device,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K] 0..15, scales [N, groups] fp32, zeros [N, groups] int, g_idx [K]) as the
    loaders hand them to the kernels; scales make the outputs O(1) for unit-variance inputs."""
    gen = torch.Generator(device=device).manual_seed(seed)
    groups = n_in // group_size
    codes = torch.randint(0, 16, (n_out, n_in), generator=gen, device=device, dtype=torch.int32)
    zeros = torch.randint(0, 16, (n_out, groups), generator=gen, device=device, dtype=torch.int32)
    scales = (torch.rand(n_out, groups, generator=gen, device=device) + 0.5) / (8 * n_in ** 0.5)
    g_idx = torch.arange(n_in, device=device) // group_size
    return codes, scales, zeros, g_idx


def _problem(name: str, n_in: int, n_out: int, m: int) -> str:
    return f"{name} {n_in}->{n_out} M={m}"


def _measure(timer: CallTimer, fn: Callable[[], torch.Tensor], ref: torch.Tensor, **fields: Any) -> KernelRun:
    diff, rel = max_diff(fn(), ref)
    return KernelRun(kernel=KERNEL, time_s=timer.median_call_s(fn), max_abs_diff=diff, rel_diff=rel, **fields)


def _with_speedups(runs: list[KernelRun]) -> list[KernelRun]:
    """Speedup of each run of one problem over the first (the dense baseline)."""
    runs[0].baseline = True
    base = runs[0].time_s
    for run in runs:
        if run.time_s and base:
            run.speedup = base / run.time_s
    return runs


def bench_int4_cuda(timer: CallTimer, rows: list[int], copy_gb_s: float) -> list[KernelRun]:
    from llmopt.kernels.triton_int4 import choose_path, dequantize, int4_matmul, pack_int4

    device = timer.device
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    runs: list[KernelRun] = []
    for name, (n_in, n_out) in LLAMA3_8B_SHAPES.items():
        codes, scales, zeros, g_idx = random_int4(n_in, n_out, CUDA_GROUP_SIZE, device)
        packed = pack_int4(codes, scales, zeros, g_idx)
        w32 = dequantize(packed)
        w16 = w32.half()
        gemlite, gemlite_skip = _gemlite_layer(codes, scales, zeros, n_in, n_out)
        del codes, g_idx
        for m in rows:
            x = torch.randn(m, n_in, device=device, dtype=torch.float16)
            ref = x.float() @ w32.t()
            common = dict(problem=_problem(name, n_in, n_out, m), reference="fp32 x @ W^T",
                          copy_bandwidth_gb_s=copy_gb_s)
            problem = [_measure(timer, lambda: F.linear(x, w16), ref, backend="cuBLAS fp16",
                                bytes_read=w16.numel() * 2, **common)]
            if interpreted:  # interpreter timings say nothing about the compiled kernel
                problem.append(KernelRun(kernel=KERNEL, backend="triton int4", skipped="TRITON_INTERPRET=1", **common))
            else:
                problem.append(_measure(timer, lambda: int4_matmul(x, packed), ref,
                                        backend=f"triton int4 ({choose_path(m)})", bytes_read=packed.nbytes(),
                                        **common))
            if gemlite is None:
                problem.append(KernelRun(kernel=KERNEL, backend="gemlite int4", skipped=gemlite_skip, **common))
            else:
                problem.append(_measure(timer, lambda: gemlite(x), ref, backend="gemlite int4",
                                        bytes_read=_gemlite_bytes(gemlite), **common))
            runs += _with_speedups(problem)
        del packed, w32, w16, gemlite
        torch.cuda.empty_cache()
    return runs


def _gemlite_layer(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, n_in: int,
                   n_out: int) -> tuple[Any, str]:
    """A GemLite 4-bit layer holding the same weight, or (None, why not)."""
    try:
        from gemlite import DType, GemLiteLinear
    except ImportError:
        return None, "gemlite not installed"
    try:  # GemLite's API moves between releases; a failure is a skipped row, not a failed run
        layer = GemLiteLinear(4, group_size=CUDA_GROUP_SIZE, in_features=n_in, out_features=n_out,
                              input_dtype=DType.FP16, output_dtype=DType.FP16)
        layer.pack(codes.to(torch.uint8), scales.half(), zeros.half(), bias=None)
        return layer, ""
    except Exception as exc:  # noqa: BLE001
        return None, f"gemlite failed: {type(exc).__name__}: {' '.join(str(exc).split())[:120]}"


def _gemlite_bytes(layer: Any) -> int | None:
    tensors = [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors) or None


def bench_int4_cpu(timer: CallTimer, rows: list[int], copy_gb_s: float) -> list[KernelRun]:
    from llmopt.kernels.cpu_int4 import (dequantize, int4_linear_kernel, int8_linear_kernel, reference_int4_linear,
                                         reference_int8_linear, repack_int4, repack_int8)
    from llmopt.kernels.cpu_linear import skinny_linear_kernel

    device = timer.device
    skinny, int4, int8 = skinny_linear_kernel(), int4_linear_kernel(), int8_linear_kernel()
    not_built = "C++ kernels not built here"
    runs: list[KernelRun] = []
    for name, (n_in, n_out) in DEFAULT_MODEL_SHAPES.items():
        p4 = repack_int4(*random_int4(n_in, n_out, CPU_GROUP_SIZE, device))
        w = dequantize(p4).contiguous()
        p4_bytes = sum(t.numel() * t.element_size() for t in (p4.codes, p4.scales, p4.zeros))
        vocabulary = name == "lm_head"
        p8 = repack_int8(w) if vocabulary else None
        w_bf16 = w.to(torch.bfloat16) if vocabulary else None
        for m in rows:
            x = torch.randn(m, n_in)
            ref = x.double() @ w.double().t()
            common = dict(problem=_problem(name, n_in, n_out, m), copy_bandwidth_gb_s=copy_gb_s)
            exact = dict(reference="fp64 x @ W^T", **common)
            problem = [_measure(timer, lambda: F.linear(x, w), ref, backend="F.linear fp32 (MKL)",
                                bytes_read=w.numel() * 4, **exact)]
            if skinny is None:
                problem.append(KernelRun(kernel=KERNEL, backend="skinny fp32 (C++)", skipped=not_built, **exact))
            else:
                problem.append(_measure(timer, lambda: skinny(x, w), ref, backend="skinny fp32 (C++)",
                                        bytes_read=w.numel() * 4, **exact))
            own = dict(reference="its PyTorch reference (int8 activations)", **common)
            if int4 is None:
                problem.append(KernelRun(kernel=KERNEL, backend="int4 (C++)", skipped=not_built, **own))
            else:
                problem.append(_measure(
                    timer, lambda: int4(x, p4.codes, p4.scales, p4.zeros, p4.out_features, p4.group_size),
                    reference_int4_linear(x, p4), backend="int4 (C++)", bytes_read=p4_bytes, **own))
            if vocabulary and int8 is not None and p8 is not None:
                problem.append(_measure(timer, lambda: int8(x, p8.codes, p8.scales, n_out),
                                        reference_int8_linear(x, p8), backend="int8 Q8_0 (C++)",
                                        bytes_read=p8.codes.numel() + p8.scales.numel() * 4, **own))
            if vocabulary and skinny is not None:
                problem.append(_measure(timer, lambda: skinny(x, w_bf16), x.double() @ w_bf16.double().t(),
                                        backend="skinny bf16 (C++)", bytes_read=w_bf16.numel() * 2,
                                        **dict(exact, reference="fp64 x @ W_bf16^T")))
            runs += _with_speedups(problem)
    return runs
