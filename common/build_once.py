"""A folder built once, safely from several processes at once.

Each builder writes a temporary sibling folder, puts a stamp in it last (its
presence means every other file is there) and renames it into place; the first
rename wins, and a later builder finds the stamp and keeps that folder. So no
reader ever sees a half-written folder, and an interrupted build leaves none.
Only an empty folder or an earlier build (a stamp of the same name) is replaced.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def is_stamped(folder: Path, stamp_name: str, stamp: str) -> bool:
    try:
        return (folder / stamp_name).read_text() == stamp
    except OSError:
        return False


def build_once(out: Path, stamp_name: str, stamp: str, build: Callable[[Path], None]) -> Path:
    """`out` holding what `build(folder)` writes, stamped with `stamp`."""
    if is_stamped(out, stamp_name, stamp):
        return out
    _refuse_foreign(out, stamp_name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        build(tmp)
        (tmp / stamp_name).write_text(stamp)
        _make_readable(tmp)
        if out.exists() and not is_stamped(out, stamp_name, stamp):
            _refuse_foreign(out, stamp_name)
            shutil.rmtree(out)  # empty, or an earlier build from other arguments
        try:
            os.rename(tmp, out)
        except OSError:
            if not is_stamped(out, stamp_name, stamp):  # not a concurrent builder that won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _refuse_foreign(out: Path, stamp_name: str) -> None:
    if out.is_dir() and not (out / stamp_name).exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not a model folder built here; "
                              "remove it or choose another folder")


def _make_readable(folder: Path) -> None:
    """mkdtemp makes the folder private; a model cache is shared like any other."""
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
