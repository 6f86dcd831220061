"""A process killed while inside torch's build lock must not stall every later llmopt process:
the C++ kernels load past a leftover lock file."""

import os
import subprocess
import sys

import pytest

from llmopt.kernels.cpu_extension import _cache_root, _digest, cpu_ops


def test_kernels_load_past_a_stale_torch_build_lock():
    if cpu_ops() is None:
        pytest.skip("llmopt's C++ kernels cannot be built here (no compiler)")
    lock = _cache_root() / "torch_extensions" / _digest() / "lock"
    lock.touch()  # what a process killed while building leaves behind
    code = "from llmopt.kernels.cpu_extension import cpu_ops; assert cpu_ops() is not None"
    done = subprocess.run([sys.executable, "-c", code], env=os.environ.copy(), timeout=300, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not lock.exists()


def test_kernels_build_from_one_copy_of_the_sources(tmp_path, monkeypatch):
    """Checkouts with the same sources (worktrees, a clone beside a venv) share one build: the
    build compiles a copy inside the digest's folder, whose path does not depend on the checkout."""
    from llmopt.kernels import cpu_extension

    first = cpu_extension._sources_in(tmp_path)
    assert [p.parent for p in first] == [tmp_path / "src"] * len(cpu_extension.SOURCES)
    assert all(p.read_bytes() == s.read_bytes() for p, s in zip(first, cpu_extension.SOURCES))
    other = tmp_path / "other-checkout"
    other.mkdir()
    for source in cpu_extension.CSRC.iterdir():
        (other / source.name).write_bytes(source.read_bytes())
    monkeypatch.setattr(cpu_extension, "CSRC", other)
    assert cpu_extension._sources_in(tmp_path) == first  # same paths for another checkout
    assert not list(tmp_path.glob("src.tmp*"))
