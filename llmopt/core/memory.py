"""Process memory: keeping freed heap for reuse or giving it back to the operating system; how much is still available."""

from __future__ import annotations

import ctypes
import functools
import ctypes.util
from pathlib import Path


@functools.cache
def _libc():
    """glibc (its malloc_trim and mallopt), or None where this is not glibc. Looked up once: find_library runs
    ldconfig."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# Blocks below this come from the heap, not each from its own mmap; this much free memory at the heap's top is
# kept rather than given back at every free.
HEAP_BLOCK_LIMIT = 32 << 20
HEAP_TOP_KEPT = 64 << 20


def reuse_freed_memory() -> bool:
    """Keep freed activation-sized blocks in the process for the next step instead of handing them back to the
    operating system. A forward pass allocates and frees the same tens of MB per layer (a prompt chunk's
    projections); with glibc's defaults (an mmap threshold that adapts as blocks are freed, the heap's top
    trimmed on free) such blocks kept arriving as fresh pages, and on a VM each page fault costs microseconds
    (MMLU's fp32 pass: 1.47M faults, 54K with this; docs/benchmarks.md, section 8, "Page faults in the prompt
    passes"). Blocks of `HEAP_BLOCK_LIMIT` and up are still mapped on their own (weights, vocabulary-sized
    rows), and `release_freed_memory` still gives the heap back where a pass asks for it. False where this
    is not glibc."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, HEAP_BLOCK_LIMIT)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, HEAP_TOP_KEPT))


def release_freed_memory() -> None:
    """glibc keeps freed blocks in its heaps; passes that allocate and free hundreds of MB
    per step (quantizing or loading layer after layer) then creep upwards in resident memory,
    hundreds of MB over a small model's layers. malloc_trim returns them."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def available_memory_bytes() -> int | None:
    """Bytes this process can still allocate: MemAvailable, lowered by the cgroup's limit
    (containers, CI runners) where one is set; None where neither can be read."""
    candidates = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                candidates.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:  # "max" or a huge number: no limit
            candidates.append(max(0, int(limit) - usage))
        break
    return min(candidates) if candidates else None
