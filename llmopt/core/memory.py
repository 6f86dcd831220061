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
