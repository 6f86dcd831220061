"""`core.memory.reuse_freed_memory`: the blocks a forward pass frees are reused by the next one instead of being
mapped afresh, each fresh page a fault (integration test on the embedded default model)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

# MMLU log-likelihoods of a few dozen questions through the fp32 default model (the eval gate's prompt path, with
# its products in bf16 where the CPU has it): page faults counted over the second of two identical passes
SCRIPT = """
import json, resource, sys
from llmopt.core.memory import reuse_freed_memory
reused = reuse_freed_memory() if sys.argv[1] == "reuse" else False
from llmopt.core.source import resolve
from llmopt.eval.metrics import loglikelihood as ll
from llmopt.eval.metrics.mmlu import build_requests, load_mmlu
from llmopt.eval.metrics.text import context_bos_id
from llmopt.loader import load
requests = build_requests(load_mmlu()[::40])
pairs = [(r.context, c) for r in requests for c in r.continuations]
loaded = load(resolve("default"))
loaded.model.use_fp32_matmul_precision("auto")
jobs, _ = ll.plan_jobs(loaded.tokenizer, pairs, 8192, context_bos_id(loaded.tokenizer, None))
ll.run_jobs(loaded.model, jobs, len(pairs))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
ll.run_jobs(loaded.model, jobs, len(pairs))
print(json.dumps({"reused": reused, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _faults(mode: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0].startswith("glibc"),
                    reason="mallopt is glibc's")
def test_a_forward_pass_reuses_the_memory_the_last_one_freed():
    default, reused = _faults("default"), _faults("reuse")
    assert reused["reused"] and not default["reused"]
    assert reused["faults"] * 2 < default["faults"], (reused, default)  # measured ~4x fewer
