"""Prints requirement specs from pyproject.toml, one a line, for pip -r.

    python scripts/pyproject_deps.py GROUP... [--only NAMES] [--without NAMES]

GROUP is `core` (the dependencies), an extra's name (its own references to
quadriga[...] expanded), or `no-deps` ([tool.quadriga] no-deps: installed with
pip --no-deps). NAMES are comma-separated distribution names. The images and
the GPU carry use it to install part of the one list without copying versions.
Needs only the standard library (tomllib: Python 3.11+).
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[([^\]]*)\])?")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def name_of(spec: str) -> str:
    return normalize(_NAME.match(spec).group(1))


def _group(project: dict, tool: dict, group: str, seen: set[str]) -> list[str]:
    if group in seen:
        return []
    seen.add(group)
    if group == "core":
        return list(project.get("dependencies", []))
    if group == "no-deps":
        return list(tool.get("no-deps", []))
    extras = project.get("optional-dependencies", {})
    if group not in extras:
        raise SystemExit(f"pyproject_deps: no group {group!r}; have core, no-deps, {', '.join(extras)}")
    out: list[str] = []
    for spec in extras[group]:
        match = _NAME.match(spec)
        if normalize(match.group(1)) == normalize(project["name"]):
            for sub in (match.group(2) or "").split(","):
                out += _group(project, tool, sub.strip(), seen)
        else:
            out.append(spec)
    return out


def specs(groups: list[str], only: set[str] | None = None, without: set[str] = frozenset()) -> list[str]:
    data = tomllib.loads(PYPROJECT.read_text())
    project, tool = data["project"], data.get("tool", {}).get("quadriga", {})
    seen: set[str] = set()
    out = [s for g in groups for s in _group(project, tool, g, seen)]
    out = [s for s in out if name_of(s) not in without and (only is None or name_of(s) in only)]
    if only is not None:
        missing = only - {name_of(s) for s in out}
        if missing:
            raise SystemExit(f"pyproject_deps: {sorted(missing)} not in {groups}")
    return out


def _names(text: str | None) -> set[str] | None:
    return None if text is None else {normalize(n) for n in text.split(",") if n.strip()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("groups", nargs="+")
    p.add_argument("--only", help="keep only these names")
    p.add_argument("--without", default="", help="leave these names out")
    a = p.parse_args(argv)
    print("\n".join(specs(a.groups, _names(a.only), _names(a.without) or set())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
