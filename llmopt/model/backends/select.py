"""`select_backend(device, dtype)`: the kernel backend a model runs on, chosen once at load.

- `CpuBackend` on CPU;
- `TritonBackend` on CUDA where Triton imports;
- `ReferenceBackend` everywhere else, and wherever `LLMOPT_KERNELS=reference` is set.
CUDA without Triton runs the PyTorch reference (several times slower at decode) and says so in a
warning at load, with the fix; `LLMOPT_KERNELS=reference` chooses that path without the warning.
`LLMOPT_KERNELS=triton` asks for the Triton kernels, on CPU through its interpreter
(`TRITON_INTERPRET=1`): how the tests run them without a GPU; without Triton it is an error.
"""

from __future__ import annotations

import logging
import os

import torch

from llmopt.kernels.triton_int4 import triton_available
from llmopt.model.backends.base import KernelBackend
from llmopt.model.backends.cpu import CpuBackend
from llmopt.model.backends.reference import ReferenceBackend
from llmopt.model.backends.triton import TritonBackend

log = logging.getLogger("llmopt")


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
        if not triton_available():
            raise ValueError("LLMOPT_KERNELS=triton: Triton is not installed here (pip install triton)")
        return TritonBackend()
    if device.type == "cpu":
        return CpuBackend()
    if device.type == "cuda":
        if triton_available():
            return TritonBackend()
        log.warning("WARNING: %s without Triton: the model runs llmopt's PyTorch reference path, not its GPU kernels "
                    "(int4 projections dequantized, attention gathered per step: several times slower). Install "
                    "the Triton that matches torch %s (pip install triton), or set LLMOPT_KERNELS=reference to "
                    "choose this path.", device, torch.__version__)
    return ReferenceBackend()
