"""build_once: several processes building one folder at once all get it whole;
only an empty folder or an earlier build is ever replaced."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from common.build_once import build_once

ROOT = Path(__file__).resolve().parents[2]

# Writes its files slowly, so the builders overlap; on return, checks that the
# folder it was given holds every file whole.
BUILDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from common.build_once import build_once

    def build(folder):
        for i in range(5):
            (folder / f"part{i}").write_text(str(i) * 1000)
            time.sleep(0.05)

    out = build_once(Path(sys.argv[1]), "stamp", "v1", build)
    assert all((out / f"part{i}").read_text() == str(i) * 1000 for i in range(5))
    print(out)
""")


def test_builders_at_once_all_get_the_whole_folder(tmp_path):
    out = tmp_path / "model"
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER, str(out)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        assert stdout.strip() == str(out)
    assert (out / "stamp").read_text() == "v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]   # no temporary folder left


def _write(folder: Path, text: str) -> None:
    (folder / "weights").write_text(text)


def test_an_earlier_build_or_an_empty_folder_is_replaced_and_a_current_one_kept(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    build_once(out, "stamp", "v1", lambda f: _write(f, "one"))
    assert (out / "weights").read_text() == "one"
    build_once(out, "stamp", "v1", lambda f: pytest.fail("built again"))
    build_once(out, "stamp", "v2", lambda f: _write(f, "two"))
    assert (out / "weights").read_text() == "two" and (out / "stamp").read_text() == "v2"


def test_a_folder_built_elsewhere_is_refused(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a model folder built here"):
        build_once(out, "stamp", "v1", lambda f: _write(f, "one"))
    assert (out / "notes.txt").read_text() == "keep me"


def test_a_failed_build_leaves_nothing(tmp_path):
    def broken(folder: Path) -> None:
        _write(folder, "half")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        build_once(tmp_path / "model", "stamp", "v1", broken)
    assert list(tmp_path.iterdir()) == []
