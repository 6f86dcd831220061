"""Where llmopt may write: checked before any long work, so bad output paths cost milliseconds, not a run.

- `check_output(path, overwrite)`: before a command starts its work, OUTPUT is new (or may be
  replaced) and its folder accepts a file (probed with a real file, not `os.access`, which says
  yes to root for `/proc`);
- `check_replaceable(path)`: `--overwrite` replaces only what llmopt wrote (a folder holding one
  of `OUTPUT_MARKERS`, an empty folder, a GGUF file), never `/`, home, the working directory or a
  folder above it;
- `inside(folder, relative, what)`: a recipe's outputs stay inside its run folder.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from llmopt.errors import LlmoptError

# Files that only llmopt writes into a checkpoint folder (core/convert.py writes the first into every
# one, quantize adds its report): a folder holding one of them is an llmopt output it may replace.
OUTPUT_MARKERS = ("llmopt_source.json", "quantize_report.json")
GGUF_MAGIC = b"GGUF"


def check_output(path: Path, overwrite: bool, flag: str = "--overwrite") -> None:
    """OUTPUT may be written: new, or replaceable with `flag` given; and its folder takes a new file."""
    path = Path(path)
    if os.path.lexists(path):
        if not overwrite:
            raise LlmoptError(f"{path} already exists; pass {flag} to replace it")
        check_replaceable(path)
    probe_writable(path)


def check_replaceable(path: Path, markers: tuple[str, ...] | None = OUTPUT_MARKERS) -> None:
    """LlmoptError unless `path` is an output llmopt wrote and replacing it deletes nothing else.

    `markers=None`: `path` lies in llmopt's own cache, where every folder is llmopt's.
    """
    path = Path(path)
    _refuse_protected(path)
    if markers is None:
        return
    if path.is_dir():
        if not any((path / m).is_file() for m in markers) and any(path.iterdir()):
            raise LlmoptError(f"{path} is a folder llmopt did not write (it holds no {' or '.join(markers)}); "
                              "llmopt replaces only its own outputs: choose a new output path, or remove the "
                              "folder yourself")
    elif path.is_file():
        if not _is_gguf(path):
            raise LlmoptError(f"{path} is a file llmopt did not write (not a GGUF file); llmopt replaces only its "
                              "own outputs: choose a new output path, or remove the file yourself")
    elif os.path.lexists(path):
        raise LlmoptError(f"{path} is neither a folder nor a file llmopt wrote; choose a new output path")


def probe_writable(path: Path) -> None:
    """Create and remove a file in the nearest existing folder on `path`'s way (nothing is left behind)."""
    path = Path(path)
    ancestor = path.parent
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise LlmoptError(f"cannot write {path}: {ancestor} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".llmopt-probe-", dir=ancestor)
    except OSError as exc:
        raise LlmoptError(f"cannot write {path}: {ancestor} does not accept files ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(probe)


def inside(folder: Path, relative: str, what: str) -> Path:
    """`folder / relative`, refused (LlmoptError naming `what`) unless it lies strictly inside `folder`."""
    if Path(relative).expanduser().is_absolute() or relative.strip() in ("", "."):
        raise LlmoptError(f"{what}: {relative!r} must name a path inside {folder} (a relative name such as "
                          "'model'); choose where the run goes with --output instead")
    target = Path(folder) / os.path.normpath(relative)
    base = Path(folder).resolve()
    if not target.resolve().is_relative_to(base) or target.resolve() == base:
        raise LlmoptError(f"{what}: {relative!r} points outside {folder}; a recipe writes only inside its run "
                          "folder (choose where the run goes with --output)")
    return target


def _refuse_protected(path: Path) -> None:
    """`/`, home, the working directory, and every folder above one of them: replacing it loses them."""
    real = path.resolve()
    for what, place in (("the working directory", Path.cwd().resolve()), ("your home folder", Path.home().resolve())):
        if place == real or place.is_relative_to(real):
            raise LlmoptError(f"{path} is {what} or a folder above it; llmopt never replaces it: "
                              "choose a new output path")


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False
