"""FP8 (e4m3) weights with a float32 scale per output row times fp32 activations on CPU, in C++
(`csrc/fp8_linear.cpp`): the codes stay one byte each in memory and are widened in registers, so
a decode step reads a quarter of fp32's weight bytes. `reference_fp8_linear` is the same product
in PyTorch (what callers without the kernels run, and what the tests compare against).
"""

from __future__ import annotations

from typing import Callable

import torch

from llmopt.kernels.cpu_extension import cpu_ops


def fp8_linear_kernel() -> Callable | None:
    """`fp8_linear(x [M, K] fp32, codes [N, K] uint8 (e4m3 bits), scales [N] fp32, bias=None) -> [M, N]`
    (contiguous inputs), or None where the CPU kernels cannot be built."""
    ops = cpu_ops()
    return None if ops is None else ops.fp8_linear


def reference_fp8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ (float(codes) * scales).T (+ bias), codes as float8_e4m3fn or their uint8 bits."""
    if codes.dtype == torch.uint8:
        codes = codes.view(torch.float8_e4m3fn)
    w = codes.to(torch.float32) * scales[:, None]
    return torch.nn.functional.linear(x, w.to(x.dtype), None if bias is None else bias.to(x.dtype))
