#!/usr/bin/env bash
# Sets up (scripts/setup.sh --test: the project with its [test] extra) and runs
# the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
.venv/bin/python scripts/gen_protos.py --check
exec .venv/bin/python -m pytest "$@"
