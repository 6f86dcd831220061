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
