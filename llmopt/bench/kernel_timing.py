"""Timing one kernel call, and the device's copy bandwidth, for `llmopt bench kernels`.

`median_call_s` times each call on its own (CUDA events on CUDA, `perf_counter` on CPU) and
returns the median after warm-up. Before every timed call a buffer larger than the
last-level cache is overwritten, outside the timed span, so each call reads its operands
from memory as a decode step does (a weight is used once per step), not from a cache that
the previous call warmed. On CUDA that write also gives Python time to queue the next call
before the GPU reaches it, so launch overhead is not counted as kernel time (the method of
`triton.testing.do_bench`).

`copy_bandwidth` is `dst.copy_(src)` of a large buffer: bytes read plus bytes written per
second, the most a kernel that streams memory can hope for on this device.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

CPU_FLUSH_MIN_BYTES = 64 << 20
CUDA_FLUSH_MIN_BYTES = 256 << 20  # as triton.testing.do_bench


def flush_bytes(device: torch.device) -> int:
    """Twice the last-level cache (CUDA: L2; CPU: L3 as Linux reports it), at least the minimum."""
    if device.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        return max(CUDA_FLUSH_MIN_BYTES, 2 * l2)
    return max(CPU_FLUSH_MIN_BYTES, 2 * _cpu_l3_bytes())


def _cpu_l3_bytes() -> int:
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return 0
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text and text[-1] in units else int(text or 0)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CallTimer:
    """Times calls on one device, flushing the cache before each; reuse one per run (the
    flush buffer is allocated once)."""

    def __init__(self, device: torch.device, warmup: int, iters: int, flush: bool = True):
        self.device, self.warmup, self.iters = device, warmup, iters
        self.flush_buffer = torch.empty(flush_bytes(device), dtype=torch.int8, device=device) if flush else None

    def _flush(self) -> None:
        if self.flush_buffer is not None:
            self.flush_buffer.fill_(1)  # a write: it evicts everything a read left in the cache

    def median_call_s(self, fn: Callable[[], Any]) -> float:
        """Median seconds of `fn()` over `iters` calls after `warmup` untimed ones."""
        for _ in range(self.warmup):
            fn()
        if self.device.type == "cuda":
            return self._cuda(fn)
        times = []
        for _ in range(self.iters):
            self._flush()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def _cuda(self, fn: Callable[[], Any]) -> float:
        pairs = []
        for _ in range(self.iters):
            self._flush()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize(self.device)
        return statistics.median(s.elapsed_time(e) for s, e in pairs) / 1e3


def copy_bandwidth(device: torch.device, size_bytes: int, iters: int = 5) -> float:
    """Bytes per second (read + written) of `dst.copy_(src)`, `size_bytes` each, median of `iters`."""
    src = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = CallTimer(device, warmup=1, iters=iters, flush=False).median_call_s(lambda: dst.copy_(src))
    del src, dst
    return 2 * size_bytes / seconds
