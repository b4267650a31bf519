"""Quadriga's OpenAI HTTP path, two or more router trees or settings side by side
in one run: benchmarks/router/peers.py's quadriga-http target, one repeat per
side in turn, the order rotating every repeat, so the box's drift falls on
every side alike.

    .venv/bin/python -m benchmarks.router.peers_ab --out results.json --repeats 3 \\
        --side base=/tmp/base-tree --side head=. \\
        --side head-thread=.:QUADRIGA_ROUTER_INLINE_TOKENIZE_CHARS=0 \\
        -- --concurrency 1 32 --max-tokens 1 64 --duration 4

A side is NAME=TREE[:KEY=VALUE,...]: peers.py runs from TREE (so its router is
that tree's code, with this tree's interpreter) with the settings given to the
router only. The JSON holds, per side and setting, each repeat's figures and
their median, min and max, and the peers.py output of every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ("added_p50_ms", "added_p99_ms", "requests_per_s", "cpu_ms_per_request")


def parse_side(text: str) -> tuple[str, Path, list[str]]:
    name, _, rest = text.partition("=")
    tree, _, settings = rest.partition(":")
    if not name or not tree:
        raise argparse.ArgumentTypeError(f"a side is NAME=TREE[:KEY=VALUE,...], not {text!r}")
    return name, Path(tree).resolve(), [s for s in settings.split(",") if s]


def git_state(tree: Path) -> str | None:
    """The tree's commit, with "+changes" when its tracked files differ from it."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=tree, capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def run_side(name: str, tree: Path, settings: list[str], peers_args: list[str], out: Path) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.router.peers", "--only", "quadriga-http", "--repeats", "1",
           "--out", str(out), *peers_args]
    for setting in settings:
        cmd += ["--router-env", setting]
    subprocess.run(cmd, cwd=tree, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    argv = sys.argv[1:]
    peers_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", action="append", type=parse_side, required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="peers-ab-"))
    sides = args.side
    rows: dict[tuple, dict] = {}
    raw = []
    for rep in range(args.repeats):
        order = sides[rep % len(sides):] + sides[: rep % len(sides)]
        for name, tree, settings in order:
            result = run_side(name, tree, settings, peers_args, work / f"{name}-{rep}.json")
            raw.append({"side": name, "repeat": rep, "result": result})
            for row in result["summary"]:
                if row["target"] != "quadriga-http":
                    continue
                key = (name, row["concurrency"], row["max_tokens"])
                entry = rows.setdefault(key, {f: [] for f in FIGURES})
                for f in FIGURES:
                    entry[f].append(row[f]["median"])
                print(f"rep {rep} {name:14s} c={row['concurrency']:<3d} n={row['max_tokens']:<3d} "
                      + "  ".join(f"{f} {row[f]['median']}" for f in FIGURES), flush=True)
    summary = []
    for (name, c, n), entry in rows.items():
        summary.append({"side": name, "concurrency": c, "max_tokens": n, **{
            f: {"median": statistics.median(v), "min": min(v), "max": max(v), "per_repeat": v}
            for f, v in entry.items()}})
    result = {
        "command": " ".join([".venv/bin/python -m benchmarks.router.peers_ab", *sys.argv[1:]]),
        "sides": [{"name": n, "tree": str(t), "settings": s, "commit": git_state(t)} for n, t, s in sides],
        "summary": summary,
        "raw": raw,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
