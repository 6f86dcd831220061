"""`select_backend(device, dtype)`: the kernel backend a model runs on, chosen once at load.

- `CpuBackend` on CPU;
- `TritonBackend` on CUDA where Triton imports;
- `ReferenceBackend` everywhere else, and wherever `LLMOPT_KERNELS=reference` is set.
`LLMOPT_KERNELS=triton` asks for the Triton kernels wherever Triton imports, on CPU through
its interpreter (`TRITON_INTERPRET=1`): how the tests run them without a GPU.
"""

from __future__ import annotations

import os

import torch

from llmopt.kernels.triton_int4 import triton_available
from llmopt.model.backends.base import KernelBackend
from llmopt.model.backends.cpu import CpuBackend
from llmopt.model.backends.reference import ReferenceBackend
from llmopt.model.backends.triton import TritonBackend


def requested_backend() -> str:
    """`LLMOPT_KERNELS`: "auto" (default), "reference" or "triton"."""
    value = os.environ.get("LLMOPT_KERNELS", "auto").strip().lower() or "auto"
    if value not in ("auto", "reference", "triton"):
        raise ValueError(f"LLMOPT_KERNELS={value!r}: choose auto, reference or triton")
    return value


def select_backend(device: torch.device, dtype: torch.dtype) -> KernelBackend:
    """The backend for a model of `dtype` on `device` (see the module docstring); ValueError for
    a bad `LLMOPT_KERNELS`."""
    requested = requested_backend()
    if requested == "reference":
        return ReferenceBackend()
    if requested == "triton":
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("LLMOPT_KERNELS=triton on CPU runs Triton's interpreter: set TRITON_INTERPRET=1 too")
        return TritonBackend() if triton_available() else ReferenceBackend()
    if device.type == "cuda" and triton_available():
        return TritonBackend()
    return CpuBackend() if device.type == "cpu" else ReferenceBackend()
