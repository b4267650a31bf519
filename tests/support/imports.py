"""What a fresh interpreter has imported after running some code: for tests that a
process's start loads no heavy library it does not need."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def heavy_modules_after(code: str, names=("torch", "transformers")) -> list[str]:
    """Which of `names` are in sys.modules once `code` has run in a new process."""
    probe = f"{code}\nimport sys\nprint(','.join(m for m in {tuple(names)!r} if m in sys.modules))\n"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [m for m in out.stdout.strip().split(",") if m]
