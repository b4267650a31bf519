#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the local stack on the CPU: an embedded
# Redis, the router and two replica workers with a tiny model built offline.
# It answers a few demo prompts, then serves until Ctrl-C.
# Extra arguments go to `python -m stack` (e.g. --replicas 3 --policy round_robin).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m stack --demo "$@"
