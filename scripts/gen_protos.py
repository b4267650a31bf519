"""Generates the Python protocol stubs under common/pb from protos/.

    python scripts/gen_protos.py           # regenerate in place
    python scripts/gen_protos.py --check   # exit 1 when the committed stubs are stale

protoc writes absolute imports (`from quadriga.v1 import generation_pb2`);
they are rewritten to the package path the stubs live under, so no sys.path
tricks are needed.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_ROOT = ROOT / "common" / "pb"
PACKAGE_PREFIX = "common.pb."


def generate(out_root: Path) -> list[Path]:
    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    generated = sorted(p for p in out_root.rglob("*") if p.suffix in (".py", ".pyi"))
    for path in generated:
        text = path.read_text()
        text = re.sub(r"^from quadriga\.", f"from {PACKAGE_PREFIX}quadriga.", text, flags=re.M)
        path.write_text(text)
    for folder in {p.parent for p in generated} | {out_root}:
        while folder != out_root.parent:
            (folder / "__init__.py").touch()
            folder = folder.parent
    return generated


def check() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        stale = []
        for path in generate(fresh):
            rel = path.relative_to(fresh)
            committed = OUT_ROOT / rel
            if not committed.exists() or not filecmp.cmp(path, committed, shallow=False):
                stale.append(str(rel))
    if stale:
        print("stale protocol stubs (run: python scripts/gen_protos.py):", *stale, sep="\n  ")
        return 1
    print("protocol stubs are up to date")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when stubs are stale")
    if parser.parse_args().check:
        return check()
    OUT_ROOT.mkdir(parents=True, exist_ok=True)
    for path in generate(OUT_ROOT):
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
