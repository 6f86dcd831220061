"""Atomic outputs: write into a temporary sibling, rename into place only when complete.

A reader never sees a half-written file or folder: either the old state or the new one.
An interrupted write leaves only a `.tmp-*` sibling, which nothing trusts. `atomic_dir` is the one
place a folder is replaced: only one llmopt wrote (output_paths.check_replaceable).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llmopt.core.output_paths import OUTPUT_MARKERS, check_replaceable
from llmopt.errors import LlmoptError


@contextmanager
def atomic_dir(final: Path, overwrite: bool = False,
               markers: tuple[str, ...] | None = OUTPUT_MARKERS) -> Iterator[Path]:
    """Yield a temporary folder; on success it becomes `final`, on error it is removed.

    With `overwrite`, an existing `final` is replaced only when it is a folder llmopt wrote (it
    holds one of `markers`; None: a cache folder, all llmopt's) and not `/`, home, the working
    directory or a folder above one: checked before the work and again before the swap. If the
    swap fails, the old folder is put back.
    Without `overwrite`, if another process created `final` meanwhile (two processes filling one
    cache), the existing folder wins and ours is discarded.
    """
    final = Path(final)
    if overwrite and os.path.lexists(final):
        check_replaceable(final, markers)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        _default_permissions(tmp, 0o777)
        for child in tmp.iterdir():
            _default_permissions(child, 0o777 if child.is_dir() else 0o666)
        if overwrite and os.path.lexists(final):
            check_replaceable(final, markers)
            _swap(tmp, final)
        else:
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _swap(new: Path, final: Path) -> None:
    """Move `final` aside, `new` into its place, then delete the old one; on failure `final` stays as it was."""
    old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
    try:
        os.rename(final, old / "x")
    except OSError as exc:
        old.rmdir()
        raise LlmoptError(f"cannot replace {final}: {exc.strerror or exc}") from None
    try:
        os.rename(new, final)
    except OSError as exc:
        os.rename(old / "x", final)
        old.rmdir()
        raise LlmoptError(f"cannot replace {final}: {exc.strerror or exc}") from None
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_file(final: Path) -> Iterator[Path]:
    """Yield a temporary path beside `final`; it replaces `final` only on success."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{final.name}.tmp-", dir=final.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        _default_permissions(tmp, 0o666)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def _default_permissions(path: Path, mode: int) -> None:
    """mkdtemp/mkstemp create private (0700/0600) entries; outputs get the usual umask'd mode."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, mode & ~umask)
