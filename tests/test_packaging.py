"""Packaging: `kernels/` installs as `llmopt.kernels` only, never as a top-level `kernels`."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_llmopt_kernels_importable_and_no_top_level_kernels(tmp_path):
    # Run from a neutral folder and without PYTHONPATH, so neither puts the repo root on sys.path: the
    # question is what the install makes importable. A top-level `kernels` that another package installed
    # (Hugging Face's own, which newer transformers releases require) is the environment's business; this
    # checkout's kernels/ must never be it.
    code = (
        "import importlib.util, llmopt.kernels;"
        "spec = importlib.util.find_spec('kernels');"
        "print(spec.origin if spec is not None else 'none');"
        "print(llmopt.kernels.__file__)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    top_level_origin, llmopt_kernels_file = out.stdout.split()
    assert Path(llmopt_kernels_file).resolve() == (ROOT / "kernels" / "__init__.py").resolve()
    if top_level_origin != "none":  # e.g. Hugging Face's `kernels`, which newer transformers requires
        assert Path(top_level_origin).resolve() != (ROOT / "kernels" / "__init__.py").resolve(), (
            "this checkout's kernels/ is importable as a top-level `kernels`"
        )


def test_wheel_maps_kernels_under_llmopt(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, cwd=tmp_path,
    )
    wheel = next(tmp_path.glob("llmopt-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "llmopt/kernels/__init__.py" in names
    assert "llmopt/loader/model_loader.py" in names
    # every package under llmopt/ is listed in pyproject.toml, and eval's data files come along
    packages = {str(p.relative_to(ROOT)) for p in (ROOT / "llmopt").glob("**/__init__.py") if "kernels" not in p.parts}
    assert packages - set(names) == set()
    assert {"llmopt/eval/data/mmlu_subset.jsonl.gz", "llmopt/eval/data/mmlu_dev.jsonl.gz"} <= set(names)
    assert not any(n.startswith("kernels/") for n in names)
    entry = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry[0]).decode()
    assert "llmopt = llmopt.cli.main:main" in text
