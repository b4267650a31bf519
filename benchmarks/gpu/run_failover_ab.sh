#!/usr/bin/env bash
# Router failover, two router trees side by side in one run: the tree here
# ("after") and the one at BASE_REV ("before", unpacked with git archive), each
# through the same failover benchmark (benchmarks/router/tier.py: 4 routers, 64
# simulated replicas, router 1 SIGKILLed a third of the way in), alternating,
# REPEATS times. On the device machine's 16 CPU cores, no GPU used. Usage
# (device tool, carrying .carry from prepare-carry.sh):
#   BASE_REV=33a4454 RATE=420 bash benchmarks/gpu/run_failover_ab.sh .carry $OUT
# Writes $OUT/failover_{after,before}_<rate>_<k>.json. DURATION (40 s), REPEATS (1).
# A dry run here: NO_CARRY=1 PYTHON=.venv/bin/python SMALL=1 BASE_REV=HEAD~1 \
#   bash benchmarks/gpu/run_failover_ab.sh - /tmp/ab
set -uo pipefail
carry=${1:-.carry}; out=$(mkdir -p "${2:-/tmp/out}" && cd "${2:-/tmp/out}" && pwd)
[ -z "${NO_CARRY:-}" ] && source benchmarks/gpu/device-env.sh "$carry" >/dev/null 2>&1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# An absolute path (not resolving links, which would leave a venv): each side runs from its own tree.
case "$PY" in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac
base_path=${PYTHONPATH:-}
base=${BASE_REV:?BASE_REV: the router revision to compare against}
rate=${RATE:-420}; duration=${DURATION:-40}; repeats=${REPEATS:-1}
before=$(mktemp -d)
# The trees compared (git archive needs the checkout's .git, which the device's copy carries).
printf 'after: %s (working tree%s)\nbefore: %s\n' "$(git rev-parse --short HEAD)" \
  "$(git diff --quiet HEAD -- . 2>/dev/null || echo ', with changes')" "$(git rev-parse --short "$base")" \
  | tee "$out/failover_ab_sides.txt"
git archive "$base" | tar -x -C "$before" || exit 1
if [ -n "${SMALL:-}" ]; then
  size=(--routers 2 --replicas 8 --per-process 4 --rates 10 --duration 2 --clients 1 --failover-routers 2)
else
  size=(--routers 4 --replicas 64 --per-process 16 --rates 100 --duration 2 --clients 4 --failover-routers 4)
fi
for k in $(seq 1 "$repeats"); do
  for side in after before; do
    dir=$PWD; [ "$side" = before ] && dir=$before
    (cd "$dir" && PYTHONPATH=$dir${base_path:+:$base_path} timeout $((duration + 120)) "$PY" -m benchmarks.router.tier \
        "${size[@]}" --failover-rate "$rate" --failover-duration "$duration" \
        --out "$out/failover_${side}_${rate}_${k}.json" 2>&1 | grep -E "^failover|Error") || echo "$side $k: failed"
  done
done
rm -rf "$before"
