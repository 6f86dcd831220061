"""Layers point down: cli -> serve/bench/eval/quant -> runtime -> model -> core, and kernels/ is a leaf.

Checked on the source (every import statement, also those inside functions), so a lazy
import cannot hide an upward dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what each package may import of llmopt (besides itself)
ALLOWED = {
    "kernels": set(),
    "llmopt/model": {"llmopt.kernels", "llmopt.core", "llmopt.errors"},
    "llmopt/runtime": {"llmopt.kernels", "llmopt.core", "llmopt.model", "llmopt.errors", "llmopt.openai_http"},
}
OWN = {"kernels": "llmopt.kernels", "llmopt/model": "llmopt.model", "llmopt/runtime": "llmopt.runtime"}


def llmopt_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n == "llmopt" or n.startswith("llmopt.")}


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_imports_point_down(folder):
    allowed = ALLOWED[folder] | {OWN[folder]}
    wrong = {}
    for path in sorted((ROOT / folder).glob("*.py")):
        bad = sorted(n for n in llmopt_imports(path) if not any(n == a or n.startswith(a + ".") for a in allowed))
        if bad:
            wrong[path.name] = bad
    assert wrong == {}, f"{folder} imports above itself: {wrong}"


def test_the_check_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from llmopt.quant.quantizer import QuantScheme\n    import llmopt.serve\n")
    assert llmopt_imports(module) == {"llmopt.quant.quantizer", "llmopt.serve"}
