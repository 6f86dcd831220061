"""The CPU KV pool's memory: zero-filled, lazily, in transparent huge pages where Linux offers them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmopt.core.huge_pages import HUGE_PAGE
from llmopt.runtime.model_runner import zeroed

THP = Path("/sys/kernel/mm/transparent_hugepage")


def _thp_mode(setting: str = "enabled") -> str | None:
    try:
        return (THP / setting).read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_pool_is_zeroed_in_any_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        pool = zeroed((4, HUGE_PAGE // 64, 2, 8), dtype, torch.device("cpu"))
        assert pool.shape == (4, HUGE_PAGE // 64, 2, 8) and pool.dtype == dtype and pool.is_contiguous()
        assert torch.count_nonzero(pool.view(torch.uint8)) == 0
    small = zeroed((3, 5), torch.float32, torch.device("cpu"))
    assert torch.equal(small, torch.zeros(3, 5))


# the page fault compacts memory for a huge page only where defrag allows it for advised ranges;
# elsewhere a fragmented machine may hand out 4 KiB pages whatever the advice
@pytest.mark.skipif(_thp_mode() not in ("madvise", "always")
                    or _thp_mode("defrag") not in ("always", "madvise", "defer+madvise"),
                    reason=f"transparent huge pages are {_thp_mode() or 'absent'} (defrag "
                           f"{_thp_mode('defrag') or 'absent'}) on this machine")
def test_large_pool_is_in_huge_pages():
    pool = zeroed((64, HUGE_PAGE // 4), torch.float32, torch.device("cpu"))  # 128 MiB
    pool.fill_(1.0)  # first touch: the kernel backs the advised range with 2 MiB pages where it can
    huge = _anon_huge_kib(pool.data_ptr())
    # some, not all: a range's unaligned ends stay in 4 KiB pages, and the kernel may fall back to them
    # where compaction finds no 2 MiB; without the advice there are none at all in "madvise" mode
    assert huge >= 2048, f"{huge} KiB of the 128 MiB pool in huge pages"
