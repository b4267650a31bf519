"""python -m benchmarks: the load-testing harness (benchmarks/harness/cli.py)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.harness.cli import main  # noqa: E402

sys.exit(main())
