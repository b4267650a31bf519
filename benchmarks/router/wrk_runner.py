"""Runs wrk (closed loop: each connection sends its next request when the last
answer is in) with completions.lua, and reads back the one JSON line it prints."""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

LUA = Path(__file__).with_name("completions.lua")
MARK = "WRK_JSON "


@dataclass(frozen=True)
class WrkSettings:
    concurrency: int
    max_tokens: int
    duration_s: int        # whole seconds: wrk takes no fractions
    threads: int
    model: str
    prompt: str
    timeout_s: int = 10


def find_wrk(path: str | None) -> str:
    found = path or shutil.which("wrk")
    if not found:
        raise SystemExit("no wrk: apt-get install -y wrk, or pass --wrk PATH "
                         "(benchmarks/router/prepare-peers-carry.sh packs Debian's)")
    return found


def wrk_version(wrk: str) -> str:
    out = subprocess.run([wrk, "--version"], capture_output=True, text=True)
    return (out.stdout + out.stderr).splitlines()[0].strip()


def run_wrk(wrk: str, url: str, s: WrkSettings) -> dict:
    """One wrk run against url; returns wrk's figures (latency in microseconds)
    plus requests_per_s, or raises with wrk's output."""
    if any(c in s.prompt for c in '"\\') or not s.prompt.isprintable():
        raise ValueError("the prompt must be plain printable text without quotes or backslashes")
    threads = max(1, min(s.threads, s.concurrency))
    cmd = [wrk, f"-t{threads}", f"-c{s.concurrency}", f"-d{s.duration_s}s",
           f"--timeout", f"{s.timeout_s:g}s", "-s", str(LUA), url,
           "--", str(s.max_tokens), s.model, s.prompt]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=s.duration_s + 60)
    line = next((x for x in out.stdout.splitlines() if x.startswith(MARK)), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stdout}\n{out.stderr}")
    row = json.loads(line[len(MARK):])
    row["requests_per_s"] = row["requests"] / (row["duration_us"] / 1e6)
    row["error_count"] = sum(row["errors"].values())
    row["threads"] = threads
    return row
