#!/usr/bin/env bash
# The simulated replica (cost model profile h200-8b) against a real H200 replica, on one
# workload. Run on the device machine from the repo root, carrying .carry (prepare-carry.sh):
#
#   bash benchmarks/gpu/validate_sim.sh engines [OUT_DIR]    # ~4 min
#   bash benchmarks/gpu/validate_sim.sh live [OUT_DIR]       # ~5 min
#   bash benchmarks/gpu/validate_sim.sh contexts [OUT_DIR]   # ~1.5 min
#
#   engines   the real EngineCore and SimulatedEngine in one process (no router): the
#             harness workload with its arrival times through the real engine, then through
#             the simulated one with every request added before the step the real run added
#             it (the schedules must be identical) and by the clock; per-step and per-request
#             TTFT/TBT/e2e errors -> OUT/sim_validation_h200_engines.json
#   live      the same harness run (python -m benchmarks run) against a stack with one real
#             replica, then against a router with one simulated replica of the same KV size;
#             per-request errors by request index -> OUT/sim_validation_h200_runs.json (TAG=h200)
#   contexts  decode step times at contexts 256/1024/4096 (bench_decode_contexts.py) ->
#             OUT/engine_h200_decode_contexts.json; copied to benchmarks/results/gpu/, it lets
#             `python -m replica_worker.sim.cost_model fit` fit per_kv_token_s too
#
# A dry run on a CPU: DEVICE=cpu NO_CARRY=1 PYTHON=.venv/bin/python PROFILE=cpu-tiny
# TAG=cpu MODEL_DIR=<tiny model> SCALE=0.0625 N=40 RATE=8 CHUNK=64 SEATS=16 bash benchmarks/gpu/validate_sim.sh live /tmp/v
set -uo pipefail
phase=${1:?engines, live or contexts}
out=$(mkdir -p "${2:-${OUT:?give OUT_DIR}}" && cd "${2:-$OUT}" && pwd)
model=${MODEL_DIR:-/tmp/llama31-8b-shape}
device=${DEVICE:-cuda}
profile=${PROFILE:-h200-8b}
tag=${TAG:-h200}  # in the result names
if [ -d .carry ] && [ -z "${NO_CARRY:-}" ] && [ -z "${CARRY_SOURCED:-}" ]; then
  source benchmarks/gpu/device-env.sh .carry && export CARRY_SOURCED=1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
[ -f "$model/config.json" ] || $PY -m benchmarks model-dir "$model" >/dev/null || exit 1
load=(); [ "$device" = cuda ] && load=(--load-format dummy)
engine=(--chunk-size "${CHUNK:-512}" --max-num-seqs "${SEATS:-128}")
work=(--workload sharegpt --scale "${SCALE:-1}" -n "${N:-100}" --rate "${RATE:-3}" --seed 1)

live() {
  local h="$out/harness" logs=/tmp/sim-validate-logs port=${PORT:-50871} mport=${METRICS_PORT:-9471}
  mkdir -p "$h" "$logs"
  replica_args=(); for a in "${load[@]}" "${engine[@]}"; do replica_args+=("--replica-arg=$a"); done
  run=(run "${work[@]}" --hardware none --no-progress --out-dir "$h" --summary-dir "$out")
  $PY -m benchmarks "${run[@]}" --start-stack --replicas 1 --device "$device" --model "$model" \
    "${replica_args[@]}" --name sim_validation_real --stack-log-dir "$logs/real" || return 1
  blocks=$(grep -ho "[0-9]* KV blocks" "$logs"/real/pull/replica-0* | head -1 | cut -d' ' -f1)
  echo "real replica: ${blocks:?no KV block count in its log} KV blocks"
  # Redis and the router only (--device matters to replicas alone; cpu would share cores among none).
  $PY -m stack --replicas 0 --device cuda --model "$model" --port "$port" --metrics-port "$mport" \
    --log-dir "$logs/sim" >"$logs/sim-stack.out" 2>&1 &
  local stack=$!
  trap 'kill -TERM $stack ${sim:-} 2>/dev/null' EXIT
  until grep -q "^ready: " "$logs/sim-stack.out"; do kill -0 $stack 2>/dev/null || return 1; sleep 0.5; done
  $PY -m replica_worker.sim --router "127.0.0.1:$port" --model "$model" --profile "$profile" \
    --replica-id sim-0 "${engine[@]}" --num-blocks "$blocks" >"$logs/sim-replica.out" 2>&1 &
  sim=$!
  until grep -q "registered with router" "$logs/sim-replica.out"; do kill -0 $sim 2>/dev/null || return 1; sleep 0.5; done
  $PY -m benchmarks "${run[@]}" --router "127.0.0.1:$port" --metrics-url "http://127.0.0.1:$mport/metrics" \
    --name sim_validation_sim
  # SIGTERM: a script's background jobs ignore SIGINT. The replica drains, the stack stops in order.
  kill -TERM $sim; wait $sim; kill -TERM $stack; wait $stack; trap - EXIT
  $PY -m benchmarks.engine.sim_validation runs "$h/sim_validation_real.csv" "$h/sim_validation_sim.csv" \
    --out "$out/sim_validation_${tag}_runs.json"
}

case $phase in
  engines)
    $PY -m benchmarks.engine.sim_validation engines --device "$device" --model "$model" "${load[@]}" \
      --profile "$profile" "${engine[@]}" "${work[@]}" --out "$out/sim_validation_${tag}_engines.json" ;;
  live) live ;;
  contexts)
    $PY benchmarks/gpu/bench_decode_contexts.py --out "$out/engine_h200_decode_contexts.json" ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
