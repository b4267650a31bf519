#!/usr/bin/env bash
# Sets up (scripts/setup.sh --test: the project with its [test] extra) and runs
# the whole test suite in QUADRIGA_TEST_WORKERS (default 2) pytest-xdist workers.
# Extra arguments go to pytest after that (`-n 0` runs it in one process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/python scripts/gen_protos.py --check
exec .venv/bin/python -m pytest -n "${QUADRIGA_TEST_WORKERS:-2}" "$@"
