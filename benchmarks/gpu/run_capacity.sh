#!/usr/bin/env bash
# The H200 capacity figures, run on the device machine from the repo root, with .carry
# from prepare-carry.sh. Each phase fits one device call (under 10 minutes):
#
#   single    one replica per GPU, at once: sarathi on GPU 0 and vllm on GPU 1, each a
#             capacity search at p99 TBT 100 ms on the sharegpt-like workload
#   chunks    sarathi's token budget (chunk size) CHUNK_A on GPU 0 and CHUNK_B on GPU 1, at once
#   pair      two replicas (GPU 0 and 1) under pull: capacity, bracketed from PAIR_FROM
#             req/s (about twice the single sarathi capacity) in steps of 1.25x
#   policies  pull, then round_robin, at 90% of CAPACITY req/s (the pair's capacity)
#   pair+policies  the two above in one call
#
# Usage: benchmarks/gpu/run_capacity.sh PHASE [OUT_DIR]; results land in OUT_DIR
# (default $OUT): <name>.json and PNG summaries, per-probe CSV/PNG under harness/,
# and each phase's log. Every run is cut at BUDGET_S seconds; a cut capacity search
# keeps the probes it finished (its JSON says "complete": false). A dry run of the
# script on a CPU: MODEL_DIR=<tiny model> DEVICE=cpu NO_CARRY=1 PYTHON=.venv/bin/python
# EXTRA_ARGS="--scale 0.0625" ... (EXTRA_ARGS goes to every harness command).
# SEATS (default 128) is every replica's --max-num-seqs; SUFFIX is appended to every
# result name, so a run with other settings keeps the earlier results beside it.
set -uo pipefail
phase=${1:?single, pair or policies}
out=$(mkdir -p "${2:-${OUT:?give OUT_DIR}}" && cd "${2:-$OUT}" && pwd)
budget=${BUDGET_S:-520}
model=${MODEL_DIR:-/tmp/llama31-8b-shape}
device=${DEVICE:-cuda}

if [ -d .carry ] && [ -z "${NO_CARRY:-}" ] && [ -z "${CARRY_SOURCED:-}" ]; then
  source benchmarks/gpu/device-env.sh .carry && export CARRY_SOURCED=1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
[ -f "$model/config.json" ] || $PY -m benchmarks model-dir "$model" >/dev/null || exit 1

cleanup() {  # stacks run in their own sessions: a run cut by timeout leaves them behind
  pkill -f -- "-m (stack|router|replica_worker)( |$)" 2>/dev/null
  pkill -f -- "redis-server (127[.]0[.]0[.]1:|.*--port)" 2>/dev/null
  sleep 1
}
cleanup

[ "$device" = cuda ] && hardware=gpu || hardware=none   # the roofline of the card it runs on
common=(--workload sharegpt --seed 1 --tbt-slo 0.1 --hardware "$hardware" --device "$device" --model "$model"
        --replica-arg=--load-format --replica-arg=dummy --replica-arg=--max-num-seqs --replica-arg="${SEATS:-128}"
        --no-progress --summary-dir "$out" ${EXTRA_ARGS:-})
chunk() { echo "--replica-arg=--chunk-size" "--replica-arg=$1"; }
vllm_budget=(--replica-arg=--max-num-batched-tokens --replica-arg=8192)  # the workload's total limit

run() {  # name, then the harness arguments
  local name=$1${SUFFIX:-}; shift
  echo "== $name: python -m benchmarks $*" >>"$out/$name.log"
  timeout -s INT -k 40 "$budget" $PY -m benchmarks "$@" --name "$name" --out-dir "$out/harness/$name" \
    --stack-log-dir "/tmp/stack-logs/$name" >>"$out/$name.log" 2>&1
  echo "== $name: exit $?" >>"$out/$name.log"
}

case $phase in
  single)
    CUDA_VISIBLE_DEVICES=0 run h200_capacity_sarathi capacity "${common[@]}" --start-stack --replicas 1 \
      --scheduler sarathi $(chunk "${CHUNK:-512}") -n "${N_SARATHI:-200}" --initial-rate "${SARATHI_FROM:-4}" --growth "${SARATHI_GROWTH:-1.5}" \
      --max-probes 6 --rel-tol 0.08 &
    CUDA_VISIBLE_DEVICES=1 run h200_capacity_vllm capacity "${common[@]}" "${vllm_budget[@]}" --start-stack \
      --replicas 1 --scheduler vllm -n "${N_VLLM:-100}" --initial-rate "${VLLM_FROM:-1.5}" --growth "${VLLM_GROWTH:-1.5}" \
      --max-probes 6 --rel-tol 0.1 &
    wait ;;
  chunks)  # sarathi's token budget: CHUNK_A on GPU 0 and CHUNK_B on GPU 1, at once
    for g in 0 1; do
      c=$([ $g = 0 ] && echo "${CHUNK_A:-1024}" || echo "${CHUNK_B:-2048}")
      CUDA_VISIBLE_DEVICES=$g run "h200_capacity_sarathi_chunk$c" capacity "${common[@]}" --start-stack \
        --replicas 1 --scheduler sarathi $(chunk "$c") -n "${N_SARATHI:-200}" \
        --initial-rate "${SARATHI_FROM:-6.5}" --growth 1.25 --max-probes 4 --rel-tol 0.08 &
    done
    wait ;;
  pair)
    run h200_capacity_pull_2replicas capacity "${common[@]}" $(chunk "${CHUNK:-512}") --start-stack --replicas 2 \
      --stack-arg=--replica-gpus=0,1 --policy pull -n "${N_PAIR:-400}" \
      --initial-rate "${PAIR_FROM:?about twice the single sarathi capacity}" --growth 1.25 \
      --max-probes "${PAIR_PROBES:-4}" --rel-tol 0.05 ;;
  pair+policies)  # both, in one call: CAPACITY is the pair's result
    BUDGET_S=${PAIR_BUDGET_S:-270} "$0" pair "$out" || true
    CAPACITY=$($PY -c "import json; print(json.load(open('$out/h200_capacity_pull_2replicas${SUFFIX:-}.json'))['capacity_req_s'] or '')")
    [ -n "$CAPACITY" ] || { echo "no pair capacity: policies not run"; exit 1; }
    BUDGET_S=${POLICIES_BUDGET_S:-230} CAPACITY=$CAPACITY "$0" policies "$out"
    exit ;;
  policies)
    run h200_policies_2replicas compare "${common[@]}" $(chunk "${CHUNK:-512}") --start-stack --replicas 2 \
      --stack-arg=--replica-gpus=0,1 --policies pull round_robin -n "${N_PAIR:-400}" \
      --capacity "${CAPACITY:?the pair capacity in req/s}" --loads 0.9 ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
cleanup
mkdir -p "$out/stack-logs"
for f in /tmp/stack-logs/*/*/*.log /tmp/stack-logs/*/*.log /tmp/stack-logs/*/*/stack.out /tmp/stack-logs/*/stack.out; do
  [ -f "$f" ] && tail -n 60 "$f" >"$out/stack-logs/$(echo "${f#/tmp/stack-logs/}" | tr / _)"
done
tail -n 40 "$out"/*.log
