"""The error of group-wise integer rounding, as AWQ's searches measure it, in one C++ pass
(`csrc/fake_quant.cpp`).

For a float32 CPU weight `w` [rows, n], an optional per-column scale `s` [n] and an optional
per-(row, group) clipping limit [rows, n // width]:

    v = clamp(w * s, -limit, limit);   error = Q(v) / s - w

where Q snaps each group of `width` columns to its integer grid (llmopt/quant/quantizer.py's
`fake_quantize`, whose result this equals bit for bit). Returns None where the kernel cannot
run (no compiled extension, a tensor not on the CPU or not float32): the caller keeps the
PyTorch path.
"""

from __future__ import annotations

import torch

from llmopt.kernels.cpu_extension import cpu_ops

_NONE = torch.empty(0)


def fake_quant_error(w: torch.Tensor, width: int, max_code: int, sym: bool, col_scale: torch.Tensor | None = None,
                     limit: torch.Tensor | None = None) -> torch.Tensor | None:
    ops = cpu_ops()
    tensors = [t for t in (w, col_scale, limit) if t is not None]
    if ops is None or any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return None
    return ops.fake_quant_error(w.contiguous(), _NONE if col_scale is None else col_scale.contiguous(),
                                _NONE if limit is None else limit.contiguous(), width, max_code, sym)
