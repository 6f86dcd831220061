"""A step's inputs (token ids, positions, slot mappings, block tables, lengths), built on the CPU
from the scheduler's lists, then moved to the model's device in as few copies as possible.

On the CPU they are used where they are. On a GPU, a `torch.tensor(list, device="cuda")` per
input would be one pageable host-to-device copy each, every one a synchronisation with the
device; instead the inputs of one dtype are packed into one pinned buffer and sent with one
non-blocking copy, and each input is a view of the device buffer (at most one copy per dtype
per step: int64 ids and slots, the kernels' int32 tables and lengths).
"""

from __future__ import annotations

import torch


def pack_by_dtype(tensors: dict[str, torch.Tensor]) -> dict[torch.dtype, torch.Tensor]:
    """One flat buffer per dtype holding `tensors` in their order (see `unpack`)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors.values():
        groups.setdefault(t.dtype, []).append(t.reshape(-1))
    return {dtype: torch.cat(parts) for dtype, parts in groups.items()}


def unpack(buffers: dict[torch.dtype, torch.Tensor], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views of `buffers` (from `pack_by_dtype(like)`, possibly on another device) shaped as `like`."""
    offsets = dict.fromkeys(buffers, 0)
    out = {}
    for name, t in like.items():
        start = offsets[t.dtype]
        out[name] = buffers[t.dtype][start : start + t.numel()].view(t.shape)
        offsets[t.dtype] = start + t.numel()
    return out


def to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """CPU-built step inputs on `device`: the same tensors on the CPU; elsewhere one
    non-blocking copy per dtype from pinned memory (CUDA orders it before the step's kernels on
    the same stream; the pinned buffer is not reused before the copy is done, as PyTorch's
    caching host allocator records the copy's stream on it)."""
    if device.type == "cpu" or not tensors:
        return tensors
    pin = device.type == "cuda"
    buffers = {dtype: (b.pin_memory() if pin else b).to(device, non_blocking=pin)
               for dtype, b in pack_by_dtype(tensors).items()}
    return unpack(buffers, tensors)
