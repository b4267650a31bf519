#!/usr/bin/env bash
# Sets up (scripts/setup.sh, then the test-only requirements-test.txt) and runs the whole
# test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
stamp=.venv/.requirements-test.sha
want=$(sha256sum requirements-test.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-test.txt
  echo "$want" > "$stamp"
fi
.venv/bin/python scripts/gen_protos.py --check
exec .venv/bin/python -m pytest "$@"
