"""Process memory: giving freed heap back to the operating system; how much is still available."""

from __future__ import annotations

import ctypes
import functools
import ctypes.util
from pathlib import Path


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None (not glibc). Looked up once: find_library runs ldconfig."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# Blocks below this come from the heap, not each from its own mmap; this much free memory at the heap's top is
# kept rather than given back at every free.
HEAP_BLOCK_LIMIT = 32 << 20
HEAP_TOP_KEPT = 64 << 20


@functools.cache
def _mallopt():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return None


def reuse_freed_memory() -> bool:
    """Keep freed activation-sized blocks in the process for the next step instead of handing them back to the
    operating system. A forward pass allocates and frees the same tens of MB per layer (a prompt chunk's
    projections); glibc by default maps each such block afresh (its adaptive mmap threshold stops at 32 MB) or
    trims the heap's top on free, so every layer touched fresh zeroed pages again: on a VM each fault costs
    microseconds (a bf16 -> fp32 copy of a 2,048 x 3,072 product took 3.5 ms instead of 0.5 ms; docs/benchmarks.md,
    section 5). Blocks of `HEAP_BLOCK_LIMIT` and up are still mapped on their own (weights, whole layers), and
    `release_freed_memory` still gives the heap back where a pass asks for it. False where this is not glibc."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, HEAP_BLOCK_LIMIT)) and bool(mallopt(_M_TRIM_THRESHOLD, HEAP_TOP_KEPT))


def release_freed_memory() -> None:
    """glibc keeps freed blocks in its heaps; passes that allocate and free hundreds of MB
    per step (quantizing or loading layer after layer) then creep upwards in resident memory,
    hundreds of MB over a small model's layers. malloc_trim returns them."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


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
