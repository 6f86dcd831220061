"""Giving freed heap memory back to the operating system."""

from __future__ import annotations

import ctypes
import ctypes.util


def release_freed_memory() -> None:
    """glibc keeps freed blocks in its heaps; passes that allocate and free hundreds of MB
    per step (quantizing layer after layer) then creep upwards in resident memory, hundreds of
    MB over a small model's layers. malloc_trim returns them."""
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc: nothing to trim
        pass


def available_memory_bytes() -> int | None:
    """Memory this process can still get: the kernel's MemAvailable, capped by the cgroup's
    limit where one is set (a container or CI job sees the host's meminfo); None if unknown."""
    available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    try:  # cgroup v2
        limit = open("/sys/fs/cgroup/memory.max", encoding="ascii").read().strip()
        used = int(open("/sys/fs/cgroup/memory.current", encoding="ascii").read().strip())
        if limit != "max":
            headroom = max(0, int(limit) - used)
            available = headroom if available is None else min(available, headroom)
    except (OSError, ValueError):
        pass
    return available
