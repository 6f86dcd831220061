"""CPU memory advised into transparent huge pages (2 MiB on x86-64 Linux) for what decode steps read.

A decode step streams every weight once and reads KV rows scattered over the pool. In 4 KiB pages each
4 KiB of a weight costs a TLB miss and a page walk, and the hardware prefetchers stop at each page
boundary; in 2 MiB pages both go away (docs/benchmarks.md, "Weights in huge pages" and "KV pool in huge
pages"). Linux gives an anonymous mapping huge pages where transparent huge pages are "always", or
"madvise" and the mapping is advised (MADV_HUGEPAGE); the advice is only advice, and where the kernel
has none to give the memory is plain pages, as without it.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable
from pathlib import Path

import torch

from llmopt.core.memory import release_freed_memory

HUGE_PAGE = 2 << 20  # x86-64 Linux's transparent huge page
LINE = 64  # each tensor moved by `move_into_huge_pages` starts on a cache line
TRIM_EVERY = 256 << 20  # bytes moved between handing the originals' freed heap back


def huge_pages_enabled() -> bool:
    """Whether this kernel may back advised anonymous memory with transparent huge pages."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in setting


def advised_region(nbytes: int) -> mmap.mmap:
    """An anonymous private mapping of `nbytes` (zeros, faulted in as first touched), advised into huge pages."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, AttributeError):  # a kernel built without THP: plain pages, as without the advice
        pass
    return region


def _key(t: torch.Tensor) -> tuple[int, int] | None:
    """Where a contiguous CPU tensor's bytes are (None for the others: non-CPU, strided, empty, opaque such as
    oneDNN's packed weights)."""
    if t is None or t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous() or t.numel() == 0:
        return None
    return t.data_ptr(), t.numel() * t.element_size()


def move_into_huge_pages(tensors: Iterable[torch.Tensor], followers: Iterable[torch.Tensor] = ()) -> int:
    """Copy contiguous CPU tensors into one mapping advised into huge pages and point each at its copy
    (`Tensor.set_`: every module, dataclass or plan holding the tensor object reads the copy); returns the
    bytes moved. Each copy has a storage of its own (a slice of the mapping, which the copies keep alive),
    as the original had, so saving or comparing storages behaves as before. Tensor objects holding the
    same bytes (a tied weight under two names, a `detach`ed alias) are moved once and keep sharing them;
    `followers` are more such objects to point at the copy where they hold the same bytes as one of
    `tensors` (without them an alias left behind would keep the original alive beside the copy). Other
    tensors (non-CPU, strided, empty) stay where they are. Nothing is moved where the kernel has no huge
    pages."""
    if not huge_pages_enabled():
        return 0
    unique: dict[tuple[int, int], list[torch.Tensor]] = {}
    seen: set[int] = set()
    for t in tensors:
        key = _key(t)
        if key is not None and id(t) not in seen:
            seen.add(id(t))
            unique.setdefault(key, []).append(t)
    if not unique:
        return 0
    for t in followers:
        key = _key(t)
        if key in unique and id(t) not in seen:
            seen.add(id(t))
            unique[key].append(t)
    sizes = [nbytes for _, nbytes in unique]
    offsets, end = [], 0
    for nbytes in sizes:
        offsets.append(end)
        end += -(-nbytes // LINE) * LINE
    region = advised_region(-(-end // HUGE_PAGE) * HUGE_PAGE)
    untrimmed = 0
    with torch.inference_mode():  # set_ on inference tensors (copies made under inference mode) is allowed only here
        for (_, nbytes), group, offset in zip(unique, unique.values(), offsets):
            first = group[0]
            copy = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)
            copy = copy.view(first.dtype).view(first.shape)
            copy.copy_(first)
            for t in group:
                t.set_(copy if t.dtype == first.dtype and t.shape == first.shape else copy.view(t.dtype).view(t.shape))
            # the originals (now unreferenced) go back to the OS as the copies fill: the peak stays the
            # weights plus a slice of them, not twice the weights (glibc keeps freed blocks under its mmap
            # threshold in the heap until trimmed)
            untrimmed += nbytes
            if untrimmed >= TRIM_EVERY:
                release_freed_memory()
                untrimmed = 0
    release_freed_memory()
    return end
