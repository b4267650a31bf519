#!/usr/bin/env bash
# Sets up (scripts/setup.sh: .venv, and SmolLM2-135M-Instruct built once into
# .cache/models/smollm2) and runs the local stack on the CPU: an embedded Redis,
# the router and two replica workers serving that model. It asks a few
# questions and prints the answers, then serves until Ctrl-C.
# Extra arguments go to `python -m stack` (e.g. --replicas 3 --policy round_robin,
# or --model DIR for another local Hugging Face folder).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m stack --demo "$@"
