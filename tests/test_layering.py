"""Layers point down. Every package of llmopt has a place in this order, and imports only what
lies below it:

    cli                                         the commands
    workflow                                    `llmopt run`: stages of the tools below
    recipes                                     the recipe file format: sections derived from the
                                                tools' requests
    quant | eval | bench | serve | plan         the tools; none imports another
    runtime                                     engines, scheduler, model runner
    loader                                      spec -> LoadedModel (our decoder on its kernel backend)
    model                                       the decoder, its layers, the kernel backends
    core                                        model files without the model: specs, configs,
                                                tokenizers, checkpoint formats, weights I/O
    kernels                                     C++ / Triton / PyTorch kernels; nothing of llmopt

Leaves anyone may import: `llmopt.errors`, `llmopt.options` (how a request declares its
options), `llmopt` itself (the version) and `llmopt.openai_http` (the OpenAI wire format:
runtime, serve, bench and eval speak it).

Checked on the source: every import statement, also those inside functions and relative
ones, so a lazy import cannot hide an upward dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LEAVES = {"llmopt", "llmopt.errors", "llmopt.options"}
FORMATS = {"llmopt.openai_http"}
KERNELS = {"llmopt.kernels"}
CORE = KERNELS | {"llmopt.core"}  # core needs no kernel; what lies below model, for the sets above it
MODEL = CORE | {"llmopt.model"}
LOADER = MODEL | {"llmopt.loader"}
RUNTIME = LOADER | {"llmopt.runtime"} | FORMATS
TOOLS = {"llmopt.quant", "llmopt.eval", "llmopt.bench", "llmopt.serve", "llmopt.plan"}
RECIPES = RUNTIME | TOOLS | {"llmopt.recipes"}
WORKFLOW = RECIPES | {"llmopt.workflow"}

# what each package may import of llmopt besides itself
ALLOWED: dict[str, set[str]] = {
    "llmopt.kernels": set(),
    "llmopt.errors": set(),
    "llmopt.options": set(),
    "llmopt.openai_http": LEAVES,
    "llmopt.core": LEAVES,
    "llmopt.model": LEAVES | CORE,
    "llmopt.loader": LEAVES | MODEL,
    "llmopt.runtime": LEAVES | LOADER | FORMATS,
    **{tool: LEAVES | RUNTIME for tool in TOOLS},
    "llmopt.recipes": LEAVES | RUNTIME | TOOLS,
    "llmopt.workflow": LEAVES | RECIPES,
    "llmopt.cli": LEAVES | WORKFLOW,
    "llmopt.__main__": {"llmopt.cli"},
}


def source_of(package: str) -> Path:
    """kernels/ sits beside llmopt/ in the repository and installs as llmopt.kernels."""
    name = package.split(".", 1)[1]
    if name == "kernels":
        return ROOT / "kernels"
    folder = ROOT / "llmopt" / name
    return folder if folder.is_dir() else folder.with_suffix(".py")


def module_name(path: Path, package: str) -> str:
    rel = path.relative_to(source_of(package)).with_suffix("") if path != source_of(package) else Path()
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([package, *parts])


def llmopt_imports(path: Path, module: str = "m") -> set[str]:
    """The llmopt modules `path` (module `module`) imports anywhere in it; relative imports resolved."""
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                names.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n == "llmopt" or n.startswith("llmopt.")}


def upward_imports(package: str, allowed: set[str]) -> dict[str, list[str]]:
    """{file: llmopt modules it imports that are neither `package` nor under an allowed one}."""
    source = source_of(package)
    files = sorted(source.rglob("*.py")) if source.is_dir() else [source]
    ok = allowed | {package}
    wrong = {}
    for path in files:
        names = llmopt_imports(path, module_name(path, package))
        # "llmopt" allows the top-level module itself only, not everything under it
        bad = sorted(n for n in names if not any(n == a or (a != "llmopt" and n.startswith(a + ".")) for a in ok))
        if bad:
            wrong[str(path.relative_to(ROOT))] = bad
    return wrong


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_point_down(package):
    assert upward_imports(package, ALLOWED[package]) == {}, f"{package} imports above itself"


def test_every_package_has_a_layer():
    found = {f"llmopt.{p.stem}" for p in (ROOT / "llmopt").iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert found - set(ALLOWED) == set(), "a new package needs its place in ALLOWED"


def test_the_layers_point_one_way():
    """No two packages may import each other, directly or around a loop."""

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        return any(n == target or (n not in seen and reaches(n, target, seen | {n})) for n in ALLOWED.get(start, ()))

    assert [p for p in ALLOWED if reaches(p, p, {p})] == []
    assert "llmopt.model" not in ALLOWED["llmopt.core"] and "llmopt.loader" not in ALLOWED["llmopt.core"]


def test_the_check_sees_lazy_and_relative_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from llmopt.quant.quantizer import QuantScheme\n    import llmopt.serve\n"
                      "from ..model import llama\nfrom . import source\n")
    assert llmopt_imports(module, "llmopt.core.m") == {"llmopt.quant.quantizer", "llmopt.serve", "llmopt.model",
                                                       "llmopt.core"}


def test_the_check_fails_on_an_upward_import(monkeypatch, tmp_path):
    """core importing the model (the cycle this test exists to keep out) is reported."""
    (tmp_path / "llmopt" / "core").mkdir(parents=True)
    (tmp_path / "llmopt" / "core" / "__init__.py").write_text("from llmopt.core.source import resolve\n")
    (tmp_path / "llmopt" / "core" / "loader.py").write_text("def load():\n    from llmopt.model.llama import X\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert upward_imports("llmopt.core", ALLOWED["llmopt.core"]) == {"llmopt/core/loader.py": ["llmopt.model.llama"]}
