"""scripts/torch_env.sh, what setup.sh and rented_gpu_bench.sh decide about torch: an installed CUDA
build is kept (never replaced), the pinned version goes in only where there is no torch or a CPU
build, and a GPU that torch cannot use stops the benchmark with one line. Run against a stub
`python` (answering the scripts' probes as a given torch would, logging pip calls) and a stub
`nvidia-smi` on PATH, so nothing is installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STUB_PYTHON = r"""#!/usr/bin/env bash
echo "$*" >> "$STUB_LOG"
[ "$1" = -m ] && exit 0                      # python -m pip install ...: logged only
[ "$STUB_TORCH" = none ] && exit 1           # import torch fails
case "$2" in
  *torch.cuda.is_available*) [ "$STUB_CUDA" = 1 ] ;;
  *'"gpu" if'*) [ "$STUB_TORCH" = gpu ] && echo gpu || echo cpu ;;
  *) echo "2.11.0+stub" ;;
esac
"""
STUB_NVIDIA_SMI = r"""#!/usr/bin/env bash
[ "$STUB_GPU" = 1 ] || exit 9
echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0000)"
"""

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@pytest.fixture
def stubs(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python", STUB_PYTHON), ("nvidia-smi", STUB_NVIDIA_SMI)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"

    def run(snippet: str, torch: str, cuda: bool = False, gpu: bool = False, **extra_env: str):
        log.write_text("")
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "STUB_LOG": str(log), "STUB_TORCH": torch,
               "STUB_CUDA": "1" if cuda else "0", "STUB_GPU": "1" if gpu else "0", "HOME": str(tmp_path), **extra_env}
        result = subprocess.run(["bash", "-c", f"set -euo pipefail; . scripts/torch_env.sh; {snippet}"],
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        pip = [line for line in log.read_text().splitlines() if line.startswith("-m pip")]
        return result, pip

    return run


def test_an_installed_cuda_torch_is_kept(stubs):
    result, pip = stubs("ensure_torch", torch="gpu")
    assert result.returncode == 0, result.stderr
    assert pip == [] and "keeping the installed GPU build" in result.stdout


@pytest.mark.parametrize("torch", ["none", "cpu"])
def test_the_pinned_torch_goes_in_where_there_is_none_or_a_cpu_build(stubs, torch):
    result, pip = stubs("ensure_torch", torch=torch)
    assert result.returncode == 0, result.stderr
    assert len(pip) == 1 and pip[0].endswith("torch==2.13.0")


def test_the_pin_follows_torch_version(stubs):
    result, pip = stubs("ensure_torch", torch="none", TORCH_VERSION="2.12.0")
    assert result.returncode == 0 and pip == ["-m pip install --quiet --disable-pip-version-check torch==2.12.0"]


@pytest.mark.parametrize("torch, flags", [("gpu", "--system-site-packages"), ("cpu", ""), ("none", "")])
def test_a_new_venv_sees_a_cuda_torch_of_the_base_python(stubs, torch, flags):
    result, _ = stubs("venv_flags python", torch=torch)
    assert result.returncode == 0 and result.stdout.strip() == flags


def test_a_gpu_torch_cannot_use_stops_the_benchmark_in_one_line(stubs):
    result, _ = stubs("if gpu_without_cuda_torch python; then exit 1; fi; echo run", torch="cpu", gpu=True)
    assert result.returncode == 1 and "run" not in result.stdout
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: nvidia-smi sees a GPU (GPU 0: NVIDIA H100 80GB HBM3)") and "cannot use CUDA" in line
    for torch, cuda, gpu in (("gpu", True, True), ("cpu", False, False), ("none", False, False)):
        result, _ = stubs("if gpu_without_cuda_torch python; then exit 1; fi; echo run", torch=torch, cuda=cuda, gpu=gpu)
        assert result.returncode == 0 and result.stdout.strip() == "run", (torch, cuda, gpu, result.stderr)


def test_the_scripts_use_these_functions():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    bench = (ROOT / "scripts" / "rented_gpu_bench.sh").read_text()
    assert ". scripts/torch_env.sh" in setup and "ensure_torch" in setup and "$(venv_flags" in setup
    assert 'pip_install "torch==' not in setup  # no path around ensure_torch
    assert "if gpu_without_cuda_torch python; then exit 1; fi" in bench
    for script in ("setup.sh", "rented_gpu_bench.sh", "torch_env.sh"):
        assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)]).returncode == 0, script
