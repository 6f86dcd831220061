"""Running many small tensor ops on one intra-op thread."""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def one_thread():
    """Loops of small or memory-bound ops (GPTQ's column loop, unpacking int4 words) gain
    nothing from a second thread, and when another process holds a core the OpenMP
    hand-offs cost far more than the work (an order of magnitude on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
