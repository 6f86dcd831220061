"""Packaging: `kernels/` installs as `llmopt.kernels` only, never as a top-level `kernels`."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_llmopt_kernels_importable_and_no_top_level_kernels(tmp_path):
    # run from a neutral folder so the repo root is not on sys.path
    code = (
        "import importlib.util, llmopt.kernels, transformers.utils.import_utils as iu;"
        "assert importlib.util.find_spec('kernels') is None, 'top-level kernels importable';"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


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
