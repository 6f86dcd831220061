"""Linear layers behind one small interface.

Every projection in the decoder is built by `make_linear`, and quantized layers (int4
AWQ / GPTQ) replace them at load without touching the model code: a linear layer is any
module mapping [..., in_features] to [..., out_features].
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.kernels.cpu_int4 import PackedInt8, int8_linear_kernel, repack_int8
from llmopt.kernels.cpu_linear import SKINNY_MAX_ROWS, PrefillKernel, skinny_linear_kernel

if TYPE_CHECKING:  # the backends hand out these layers; the layers need the backend only for hints
    from llmopt.model.backends import KernelBackend


class LinearBase(nn.Module):
    in_features: int
    out_features: int

    def prepare(self, backend: KernelBackend) -> None:
        """Called once after loading, with the model's kernel backend (`llmopt.model.backends`):
        choose the kernels and convert weights to the layout the forward wants. A caller that
        replaces the weight afterwards calls it again."""

    def streamed_weight_bytes(self) -> int:
        """Bytes of weights (and bias) one forward reads: what a decode step costs in memory traffic."""
        return sum(t.numel() * t.element_size() for t in self.streamed_tensors() if t is not None)

    def streamed_tensors(self) -> list[torch.Tensor | None]:
        """The tensors a decode forward reads, whole (None for an absent bias)."""
        return [*self.buffers(recurse=False), *self.parameters(recurse=False)]


class DenseLinear(LinearBase):
    """A plain (fp32 / fp16 / bf16) linear layer with Hugging Face tensor names.

    `prepare(backend)` asks the kernel backend which kernels this weight runs on
    (`KernelBackend.dense_linear_kernels`); the forward then takes:
    - up to `SKINNY_MAX_ROWS` rows (decode steps), the backend's few-row kernel where it gave one;
    - more rows, oneDNN's matmul where the backend gave a weight for it: a copy pre-packed once
      (very wide layers: the vocabulary projection), or the plain weight itself on CPUs where
      oneDNN's fp32 GEMM is the faster one (`llmopt.kernels.cpu_linear.fp32_gemm`);
    - everything else (prompt chunks, perplexity windows), `F.linear`, as transformers.
    Results agree with `F.linear` to float rounding; the few-row kernel's result for a row does
    not depend on the other rows. The packed copy sits beside the plain weight (checkpoints and
    tied embeddings use that one).

    `use_prefill_kernel(kernel)` sends the fp32 products of more than `SKINNY_MAX_ROWS` rows
    (prompt chunks, perplexity windows) through `kernel` instead: the backend's bf16 math under the
    engine's `fp32_matmul_precision` (`KernelBackend.fp32_prefill_linear`), on the weight itself or on the
    kernel's copy of it (`PrefillKernel.weight_copy`), made at the first such call; a caller that changes
    the weight afterwards calls `use_prefill_kernel` again.

    `use_compact_copy("bf16" | "int8")` makes every fp32 CPU call, whatever the row count,
    multiply by a smaller copy of the weight: bf16 through the skinny kernel (half the bytes),
    or 8 bits per weight with a scale per 32 columns (llama.cpp's Q8_0) through the int8
    kernel of `llmopt.kernels.cpu_int4` (a quarter). int4 models use it for the vocabulary
    projection where their backend says so (`llmopt.loader`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.onednn_weight: torch.Tensor | None = None
        self.skinny: Callable | None = None
        self.bf16_weight: torch.Tensor | None = None
        self.int8_weight: PackedInt8 | None = None
        self.int8_kernel: Callable | None = None
        self.prefill: PrefillKernel | None = None
        self.prefill_bf16_result = False  # prompt-sized products returned as the kernel's bf16 rounding
        self.prefill_weight: torch.Tensor | None = None  # the prefill kernel's copy of the weight

    def prepare(self, backend: KernelBackend) -> None:
        """Once the weights are loaded: take the kernels the backend has for this weight."""
        self.skinny, self.onednn_weight = backend.dense_linear_kernels(self.weight)

    def use_prefill_kernel(self, kernel: PrefillKernel | None, bf16_result: bool = False) -> bool:
        """Prompt-sized products through `kernel` from now on (None: the plain path), where the weight is fp32
        on CPU; returns whether they are. `bf16_result`: return them in bf16 where the kernel's result is a bf16
        rounding anyway (`PrefillKernel.bf16_on_copy`) and there is no bias: the consumer takes bf16 rows."""
        w = self.weight
        self.prefill = kernel if w.device.type == "cpu" and w.dtype == torch.float32 else None
        self.prefill_weight = None
        self.prefill_bf16_result = (bf16_result and self.prefill is not None and self.prefill.bf16_on_copy is not None
                                    and self.bias is None)
        return self.prefill is not None

    def _prefill_weight(self) -> torch.Tensor:
        if self.prefill.weight_copy is None:
            return self.weight
        if self.prefill_weight is None:
            self.prefill_weight = self.prefill.weight_copy(self.weight)
        return self.prefill_weight

    def use_compact_copy(self, kind: str) -> bool:
        """Multiply fp32 CPU inputs by a "bf16" or "int8" copy of the weight from now on; False
        (and no copy) where the kernel is not available or the weight is not on CPU."""
        w = self.weight  # fp32, or a 16-bit checkpoint's table kept as it was (`llmopt.loader`)
        if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
        if kind == "bf16":
            kernel = skinny_linear_kernel()
            if kernel is None:
                return False
            self.skinny, self.bf16_weight = kernel, w.detach().to(torch.bfloat16).contiguous()
        elif kind == "int8":
            kernel, packed = int8_linear_kernel(), repack_int8(w.detach())
            if kernel is None or packed is None:
                return False
            self.int8_kernel, self.int8_weight = kernel, packed
        else:
            raise ValueError(f"unknown compact weight kind {kind!r}; choose bf16 or int8")
        self.onednn_weight = None
        return True

    def streamed_tensors(self) -> list[torch.Tensor | None]:
        if self.int8_weight is not None:
            return [self.int8_weight.codes, self.int8_weight.scales, self.bias]
        return [self.bf16_weight if self.bf16_weight is not None else self.weight, self.bias]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.int8_weight is not None:
            q = self.int8_weight
            out = self.int8_kernel(x.reshape(rows, self.in_features).contiguous(), q.codes, q.scales, q.out_features)
            out = out if self.bias is None else out + self.bias
            return out.view(*x.shape[:-1], self.out_features)
        if self.bf16_weight is not None:
            out = self.skinny(x.reshape(rows, self.in_features).contiguous(), self.bf16_weight, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        if self.skinny is not None and rows <= SKINNY_MAX_ROWS:
            out = self.skinny(x.reshape(rows, self.in_features).contiguous(), self.weight, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        if self.prefill is not None:
            x2 = x.reshape(rows, self.in_features)
            if self.prefill_bf16_result:
                out = self.prefill.bf16_on_copy(x2, self._prefill_weight())
            else:
                out = self.prefill.on_copy(x2, self._prefill_weight(), self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        if self.onednn_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def make_linear(in_features: int, out_features: int, bias: bool = False) -> LinearBase:
    """The decoder's projection as the model is built: a `DenseLinear`. AWQ / GPTQ projections
    replace it at load with the int4 layer of the model's kernel backend
    (`KernelBackend.int4_linear`)."""
    return DenseLinear(in_features, out_features, bias)
