"""Helpers every benchmark shares: percentiles, result files, the reproduce command."""

from __future__ import annotations

import json
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent


def rss_mb(pid: int | str = "self") -> float:
    """A process's resident memory now, in MiB (NaN if /proc does not say)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def tree_commit(tree: Path = ROOT) -> str:
    """A tree's commit: its COMMIT file, else git's answer if the tree is a
    checkout's root (with ' (modified)' when tracked files differ from it).
    A COMMIT file comes first: a copy made by git archive has one
    (prepare-device-cpu-carry.sh), and a device call should carry one written
    just before it (`git rev-parse HEAD > COMMIT`), since the device copy's git
    names the commit its session started from, not the tree's. A COMMIT file
    older than the checkout's last commit is one left behind by an earlier call,
    and git is asked instead."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(tree), *args], capture_output=True,
                                  text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    top = git("rev-parse", "--show-toplevel")
    at_root = bool(top) and Path(top).resolve() == tree.resolve()
    named = tree / "COMMIT"
    if named.exists():
        committed = git("log", "-1", "--format=%ct") if at_root else ""
        if not committed.isdigit() or named.stat().st_mtime >= int(committed):
            return named.read_text().strip()
    if not at_root:
        return "unknown (not a git checkout's root)"
    modified = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "HEAD") + (" (modified)" if modified else "")


def percentile(values, q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; None for no values."""
    values = list(values)
    if not values:
        return None
    return float(numpy.percentile(values, q))


def summarize(values) -> dict:
    values = list(values)
    return {
        "n": len(values),
        "mean": sum(values) / len(values) if values else None,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values) if values else None,
    }


def save_result(name: str, payload: dict) -> Path:
    """Writes RESULTS/name.json with the command that reproduces it."""
    path = RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        **payload,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
