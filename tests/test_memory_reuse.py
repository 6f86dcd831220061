"""`core.memory.reuse_freed_memory`: activation-sized blocks a pass frees are reused by the next pass instead of
being handed back to the operating system and faulted in afresh, each fresh page a fault (on a VM, microseconds
each).

The workload is the allocation pattern itself, through glibc's malloc and free: a forward pass's tensors come
from the same calls, but which of them sit at the heap's top (the part glibc trims) depends on the model's
activation dtypes and on every small allocation in between, so a model's pass made a test whose counts swung
by orders of magnitude between runs. Here the pattern is fixed: a "layer" holds five 8 MiB blocks (a 2,048-row
fp32 product of width 1,024) and frees them, eight layers a pass."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

BLOCK_MIB, BLOCKS_PER_LAYER, LAYERS = 8, 5, 8

SCRIPT = """
import ctypes, ctypes.util, json, resource, sys
# 4 KiB pages, so faults count pages whatever the machine's transparent huge page setting (PR_SET_THP_DISABLE)
ctypes.CDLL(None, use_errno=True).prctl(41, 1, 0, 0, 0)
from llmopt.core.memory import reuse_freed_memory
reused = reuse_freed_memory() if sys.argv[1] == "reuse" else False
block, per_layer, layers = int(sys.argv[2]) << 20, int(sys.argv[3]), int(sys.argv[4])
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]

def one_pass():
    for _ in range(layers):
        blocks = [libc.malloc(block) for _ in range(per_layer)]
        for address in blocks:
            libc.memset(address, 1, block)  # written, as a product's result is
        for address in reversed(blocks):
            libc.free(address)

one_pass()  # the first pass maps its memory in either mode
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
one_pass()
print(json.dumps({"reused": reused, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _faults(mode: str) -> dict:
    args = [str(BLOCK_MIB), str(BLOCKS_PER_LAYER), str(LAYERS)]
    # glibc's own settings from the environment (MALLOC_TRIM_THRESHOLD_ and the like) would change the defaults
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode, *args], capture_output=True, text=True,
                          env={**env, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0].startswith("glibc"),
                    reason="mallopt is glibc's")
def test_a_pass_reuses_the_memory_the_last_one_freed():
    default, reused = _faults("default"), _faults("reuse")
    assert reused["reused"] and not default["reused"]
    layer_pages = BLOCK_MIB * BLOCKS_PER_LAYER * (1 << 20) // os.sysconf("SC_PAGE_SIZE")
    # glibc's defaults give each layer's 40 MiB back when it is freed (the heap's top trimmed above twice the
    # largest block seen) and the next layer faults it in again: measured 65,280 faults a pass, 0 with reuse
    assert default["faults"] > layer_pages * LAYERS // 2, (default, layer_pages)
    assert reused["faults"] < layer_pages // 10, (reused, layer_pages)
