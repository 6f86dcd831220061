"""Running many small tensor ops on one intra-op thread."""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def one_thread():
    """Loops of small or memory-bound ops (GPTQ's column loop, unpacking int4 words) gain
    nothing from a second thread, and when another process holds a core the OpenMP
    hand-offs cost far more than the work: measured on this 2-core machine under load,
    GPTQ on a 3072x576 weight took 0.74 s on one thread and 12 s on two; unpacking an
    AWQ weight 7 ms and 577 ms."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
