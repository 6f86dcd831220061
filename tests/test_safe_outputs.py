"""Outputs never cost data: `--overwrite` replaces only what llmopt wrote, never the working directory,
a folder above it, `/` or home; a recipe writes only inside its run folder; commands.sh runs only
the commands it lists, whatever the recipe's file name or the model's path holds."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import assert_usage_error, run_cli

from llmopt.errors import LlmoptError

RTN = ["--method", "rtn", "--group-size", "32"]


def _leftovers(folder: Path) -> list[str]:
    """The temporary siblings atomic_dir makes (`.NAME.tmp-*`, `.NAME.old-*`)."""
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


# ---------------------------------------------------------------------------- --overwrite


def test_overwrite_refuses_a_folder_llmopt_did_not_write(tiny_models, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    assert_usage_error(["quantize", str(tiny_models["llama"]), "-o", str(mine), *RTN, "--overwrite"],
                       str(mine), "llmopt did not write")
    assert (mine / "thesis.tex").read_text() == "years of work"
    assert _leftovers(tmp_path) == []


def test_overwrite_refuses_a_file_llmopt_did_not_write(tiny_models, tmp_path):
    notes = tmp_path / "notes.gguf"
    notes.write_text("not a model")
    assert_usage_error(["quantize", str(tiny_models["llama"]), "-o", str(notes), "--method", "gguf",
                        "--gguf-type", "Q8_0", "--overwrite"], "llmopt did not write")
    assert notes.read_text() == "not a model"


@pytest.mark.parametrize("where,fragment", [(".", "working directory"), ("..", "working directory"),
                                            ("/", "working directory"), ("HOME", "home folder")])
def test_overwrite_refuses_the_working_directory_its_parents_root_and_home(tiny_models, tmp_path, monkeypatch,
                                                                          where, fragment):
    cwd = tmp_path / "a" / "b"
    cwd.mkdir(parents=True)
    (cwd / "llmopt_source.json").write_text("{}")  # even with llmopt's marker in it
    home = tmp_path / "home"
    home.mkdir()
    (home / "llmopt_source.json").write_text("{}")
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(home))
    target = str(home) if where == "HOME" else where
    assert_usage_error(["quantize", str(tiny_models["llama"]), "-o", target, *RTN, "--overwrite"], fragment)
    assert sorted(p.name for p in cwd.iterdir()) == ["llmopt_source.json"]  # no `..old-*` folder left
    assert sorted(p.name for p in home.iterdir()) == ["llmopt_source.json"]
    assert _leftovers(tmp_path / "a") == [] and _leftovers(tmp_path) == []


def test_overwrite_replaces_llmopts_own_output(tiny_models, tmp_path):
    out = tmp_path / "q"
    for _ in range(2):
        code, err, _ = run_cli("quantize", str(tiny_models["llama"]), "-o", str(out), *RTN, "--overwrite")
        assert code == 0, err
    assert (out / "quantize_report.json").is_file() and (out / "llmopt_source.json").is_file()
    assert _leftovers(tmp_path) == []


def test_a_failed_swap_keeps_the_old_folder_and_leaves_nothing(tmp_path, monkeypatch):
    """`-o .` used to fail with EBUSY half way and leave a `..old-*` folder: a rename that fails now
    restores the old folder and removes its temporary siblings."""
    from llmopt.core import atomic

    final = tmp_path / "out"
    final.mkdir()
    (final / "llmopt_source.json").write_text("old")
    real_rename = os.rename

    def busy(src, dst):
        if Path(src) == final:
            raise OSError(errno.EBUSY, "Device or resource busy")
        return real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", busy)
    with pytest.raises(LlmoptError, match="cannot replace"):
        with atomic.atomic_dir(final, overwrite=True) as tmp:
            (tmp / "llmopt_source.json").write_text("new")
    assert (final / "llmopt_source.json").read_text() == "old"
    assert _leftovers(tmp_path) == []

    def second_fails(src, dst):  # the new folder cannot move into place; putting the old one back works
        if Path(dst) == final and ".tmp-" in Path(src).name:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", second_fails)
    with pytest.raises(LlmoptError, match="cannot replace"):
        with atomic.atomic_dir(final, overwrite=True) as tmp:
            (tmp / "llmopt_source.json").write_text("new")
    monkeypatch.setattr(atomic.os, "rename", real_rename)
    assert (final / "llmopt_source.json").read_text() == "old"
    assert _leftovers(tmp_path) == []


def test_models_convert_force_refuses_a_folder_llmopt_did_not_write(tiny_models, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("x")
    assert_usage_error(["models", "convert", str(tiny_models["llama"]), "-o", str(mine), "--force"],
                       "llmopt did not write")
    assert (mine / "keep.txt").is_file()


# ---------------------------------------------------------------------------- recipes


def _recipe(path: Path, model: Path, extra: str = "") -> Path:
    path.write_text(f"model: {json.dumps(str(model))}\nquantize: {{method: rtn, group_size: 32}}\n{extra}",
                    encoding="utf-8")
    return path


@pytest.mark.parametrize("output,fragment", [("ABS", "inside"), ("../..", "outside"), ("../elsewhere", "outside"),
                                             (".", "inside"), ("results.json", "own files")])
def test_recipe_quantize_output_stays_inside_the_run_folder(tiny_models, tmp_path, output, fragment):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "llmopt_source.json").write_text("{}")  # llmopt's marker: only the recipe rule protects it
    value = str(victim) if output == "ABS" else output
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {tiny_models['llama']}\nquantize: {{method: rtn, group_size: 32, output: '{value}'}}\n")
    run = tmp_path / "runs" / "x"
    assert_usage_error(["run", str(recipe), "-o", str(run)], "quantize.output", fragment)
    assert not run.exists() and sorted(p.name for p in victim.iterdir()) == ["llmopt_source.json"]


@pytest.mark.parametrize("name", ["/abs", "../..", "..", "."])
def test_recipe_name_stays_inside_runs(tiny_models, tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    value = str(tmp_path / "abs") if name == "/abs" else name
    recipe = _recipe(tmp_path / "r.yaml", tiny_models["llama"], f"name: '{value}'\n")
    assert_usage_error(["run", str(recipe)], "name")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


def test_commands_sh_runs_only_its_commands(tiny_models, tmp_path):
    """A newline in the recipe's file name used to end the `#` comment of commands.sh and run the rest;
    a model path with `$(...)` must stay one quoted word."""
    if shutil.which("sh") is None:
        pytest.skip("no /bin/sh to run commands.sh with")
    model = shutil.copytree(tiny_models["llama"], tmp_path / "m $(touch PWNED_MODEL) `touch PWNED_TICK`")
    recipe = _recipe(tmp_path / "evil\ntouch PWNED_NAME\n.yaml", model)
    out = tmp_path / "out"
    code, err, _ = run_cli("run", str(recipe), "-o", str(out))
    assert code == 0, err
    script = (out / "commands.sh").read_text()
    assert "\\ntouch PWNED_NAME\\n" in script  # the name is still readable, escaped
    # run it as a user would, with `llmopt` a function that records its arguments
    calls = tmp_path / "calls"
    subprocess.run(["sh", "-c", f'llmopt() {{ printf "%s|" "$@" >> "{calls}"; echo >> "{calls}"; }}; . ./commands.sh'],
                   cwd=out, check=True, timeout=30)
    assert not list(out.glob("PWNED*")) and not list(tmp_path.glob("PWNED*"))
    lines = calls.read_text().splitlines()
    assert lines[0].split("|")[:2] == ["quantize", str(model)]  # the path arrived whole, as one word
    assert len(lines) == 2  # quantize, serve: nothing else ran
