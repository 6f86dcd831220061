"""int4 linear layers for AWQ / GPTQ checkpoints.

- `CpuInt4Linear` (fp32 models, the default on CPU): llmopt's C++ kernel
  (`llmopt.kernels.cpu_int4`), 4-bit weights times activations quantized to int8 per 32
  values; the weights stay 4-bit in memory, so a decode step reads ~1/7 of the fp32 bytes.
- `Int4Linear` (bf16 / fp16 models): PyTorch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`).

The core reads AWQ / GPTQ / compressed-tensors checkpoints into per-group scales and zero points
with the codes left packed (`PackedQuantizedWeight`); each layer repacks the codes once, at load,
a slab of output rows at a time, into its kernel's layout (on the target device for Triton). PyTorch's
kernel computes w = (code - 8) * scale + offset per group, so our zero points become
offset = (8 - zero) * scale. It needs groups of 32/64/128/256 contiguous input columns:
act-order checkpoints (a permuted g_idx) are handled by permuting the input columns
once per call, and per-channel (-1) grids by repeating the scale over 64-column groups.
PyTorch's kernel is slow with fp32 activations (docs/benchmarks.md), hence llmopt's own
kernel for fp32 models.

- `TritonInt4Linear` (CUDA; CPU only under TRITON_INTERPRET=1): llmopt's Triton
  dequant-matmul (`llmopt.kernels.triton_int4`) for fp16 / bf16 / fp32 activations: the
  layer of the "triton" backend (CUDA).

Each kernel backend picks its layer (`KernelBackend.int4_linear`, `llmopt.model.backends`).
"""

from __future__ import annotations

import torch

from llmopt.kernels import cpu_int4
from llmopt.kernels.cpu_int4 import PackedInt4, int4_linear_kernel, repack_int4_rows
from llmopt.kernels.triton_int4 import PackedInt4 as TritonPackedInt4
from llmopt.kernels.triton_int4 import int4_matmul, pack_int4_rows, triton_available
from llmopt.model.linear import LinearBase
from llmopt.core.quantized_weight import PackedQuantizedWeight, QuantizedWeight

KERNEL_GROUP_SIZES = (32, 64, 128, 256)


class Int4Linear(LinearBase):
    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                 in_features: int, out_features: int, bias: torch.Tensor | None, perm: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group_size = group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("perm", perm)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.perm is not None:
            flat = flat.index_select(1, self.perm)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat.to(self.scales_and_zeros.dtype).contiguous(), self.packed, self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def int4_linear(q: QuantizedWeight | PackedQuantizedWeight, bias: torch.Tensor | None,
                dtype: torch.dtype) -> Int4Linear | None:
    """The kernel layer for `q`, or None when the kernel cannot take it (caller keeps dense weights).
    The codes are converted a slab of output rows at a time (PyTorch's packing is per 64 rows, so
    the slabs give its layout for the whole weight)."""
    out_features, in_features = q.shape
    groups = q.scales.shape[1]
    scales, zeros, perm = q.scales, q.zeros.float(), None
    if not q.is_sequential():
        perm = torch.argsort(q.g_idx.long(), stable=True)
        if not torch.equal(torch.bincount(q.g_idx.long(), minlength=groups), torch.full((groups,), in_features // groups)):
            return None  # uneven groups cannot be made contiguous
    width = in_features // groups
    if width not in KERNEL_GROUP_SIZES:
        if groups == 1 and in_features % 64 == 0:  # per-channel grid: the same scale repeated per 64 columns
            repeat = in_features // 64
            scales, zeros, width = scales.repeat(1, repeat), zeros.repeat(1, repeat), 64
        else:
            return None
    packed = torch.empty(out_features, in_features // 2, dtype=torch.uint8)
    step = 64 * max(1, cpu_int4.SLAB_CODES // (64 * in_features))
    try:
        for start in range(0, out_features, step):
            stop = min(start + step, out_features)
            codes = q.code_rows(start, stop)
            if perm is not None:
                codes = codes[:, perm]
            codes = codes.to(torch.int32).contiguous()
            packed[start:stop] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    except RuntimeError:
        return None
    scales_and_zeros = torch.stack([scales.t(), ((8 - zeros) * scales).t()], dim=-1).to(dtype).contiguous()
    return Int4Linear(packed, scales_and_zeros, width, in_features, out_features,
                      None if bias is None else bias.to(dtype), perm)


class CpuInt4Linear(LinearBase):
    """fp32 in, fp32 out, 4-bit weights in the kernel's layout (`llmopt.kernels.cpu_int4`).

    Every row count goes through the same kernel (AVX-512 VNNI for decode batches, AMX tiles
    for prompt chunks where the CPU has them; every path bitwise the same), so a token's
    projections are computed identically in a prompt chunk and in a decode step, alone or in a
    batch.
    """

    def __init__(self, packed: PackedInt4, bias: torch.Tensor | None, kernel):
        super().__init__()
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.group_size = packed.group_size
        self.register_buffer("codes", packed.codes)
        self.register_buffer("scales", packed.scales)
        self.register_buffer("zeros", packed.zeros)
        self.register_buffer("perm", packed.perm)
        self.bias = None if bias is None else torch.nn.Parameter(bias.float().contiguous(), requires_grad=False)
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype is not torch.float32 or not flat.is_contiguous():
            flat = flat.float().contiguous()
        y = self.kernel(flat, self.codes, self.scales, self.zeros, self.out_features, self.group_size, self.perm,
                        self.bias)
        return y.view(*x.shape[:-1], self.out_features)


def cpu_int4_linear(q: QuantizedWeight | PackedQuantizedWeight, bias: torch.Tensor | None) -> CpuInt4Linear | None:
    """The C++ kernel layer for `q` (fp32 CPU models), its codes repacked a slab of output rows at
    a time; None when the kernel is not built or cannot take the weight's layout (the caller keeps
    dense weights)."""
    kernel = int4_linear_kernel()
    packed = None if kernel is None else repack_int4_rows(q.code_rows, q.shape, q.scales, q.zeros, q.g_idx)
    return None if packed is None else CpuInt4Linear(packed, bias, kernel)


class TritonInt4Linear(LinearBase):
    """x [..., K] in fp16 / bf16 / fp32 -> [..., N] in x's dtype, through `int4_matmul`.

    The packed tensors are buffers, so `.to("cuda")` moves the layer like any module.
    """

    def __init__(self, packed: TritonPackedInt4, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.group_size = packed.group_size
        self.register_buffer("qweight", packed.qweight)
        self.register_buffer("scales", packed.scales)
        self.register_buffer("zeros", packed.zeros)
        self.register_buffer("perm", packed.perm)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)

    def packed(self) -> TritonPackedInt4:
        return TritonPackedInt4(self.qweight, self.scales, self.zeros, self.perm, self.in_features, self.out_features,
                                self.group_size)

    def streamed_tensors(self) -> list[torch.Tensor | None]:
        # a forward reads the packed codes, the scales and zero points, the act-order permutation
        return [self.qweight, self.scales, self.zeros, self.perm, self.bias]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int4_matmul(x, self.packed(), self.bias)


def triton_int4_linear(q: QuantizedWeight | PackedQuantizedWeight, bias: torch.Tensor | None,
                       device: torch.device | str | None = None) -> TritonInt4Linear | None:
    """The Triton kernel layer for `q`, packed on `device` (default: the CPU) a slab of output
    channels at a time; None when Triton is not installed or the kernel cannot take the weight's
    layout (the caller keeps dense weights)."""
    if not triton_available():
        return None
    device = torch.device("cpu") if device is None else torch.device(device)
    try:
        packed = pack_int4_rows(q.code_rows, q.shape, q.scales, q.zeros, q.g_idx, device)
    except ValueError:
        return None
    return TritonInt4Linear(packed, None if bias is None else bias.to(device))

