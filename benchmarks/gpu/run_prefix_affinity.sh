#!/usr/bin/env bash
# Cache-affine scheduling on ONE H200: two replicas share the GPU, each with half of
# it, Llama-3.1-8B shape with dummy weights. Capacity (highest Poisson rate with p99
# TTFT <= 2 s, p99 TBT <= 100 ms, p50 scheduling delay <= 2 s, keeping up) per policy.
# Run on the device machine from the repo root, with .carry from prepare-carry.sh:
#
#   benchmarks/gpu/run_prefix_affinity.sh PHASE [OUT_DIR]
#
#   cache        shared-prefix, engine cache off: pull, round_robin (pull with it on is in
#                shared-pull)
#   shared-pull  shared-prefix: pull_fifo (affinity off), pull (affinity on)
#   shared-push  shared-prefix: round_robin, cache_aware
#   chat-pull    multi-turn: pull_fifo, pull
#   chat-push    multi-turn: round_robin, cache_aware
#   shared-load, chat-load   pull_fifo and pull at one load: LOADS (default 0.7) of
#                CAPACITY (req/s or conversations/s, required: pull_fifo's), one run each
#                (the harness's compare; #14's TTFT p50 at 70% load), both runs within one
#                BUDGET_S: give it room for two stack starts and two runs (420 on an H100)
#
# Each phase is two capacity searches of at most BUDGET_S (default 215) seconds each,
# stack start included, so a phase ends within 9 minutes (a cut search keeps the probes
# it finished; its JSON says "complete": false). Results: OUT_DIR/<card>_prefix_<workload>_
# <policy>_cache<on|off>.json (every probe, the harness command), its PNG, the log, the
# GPU's clocks (.gpu.csv); <card>
# is the GPU the run is on (h200, h100; gpu for another; cpu in a dry run).
# Gather them with `python -m benchmarks repeats --out OUT_DIR/<card>_prefix LABEL=JSON ...`.
#
# Memory. The replica's --gpu-memory-utilization is a share of the whole GPU that
# counts what every process on it holds (KV = total x share - used), so two replicas
# starting at once would each see the other's weights and race. Each replica gets
# --num-blocks instead: (total x 0.9 / 2 - weights - RESERVE_MIB) / 2 MiB a block
# (16 tokens x 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes). On a 141 GB H200
# that is about 23k blocks, 370k tokens a replica. NUM_BLOCKS overrides it.
#
# Workloads (lengths chosen so that one replica's cache cannot hold every prefix and
# two can: the regime where placement decides the hit rate):
#   shared  128 groups of a 4096-token system prompt (524k tokens, 1.4 replicas' caches),
#           6 questions each (128-512 tokens), 64-token answers: 768 requests a probe
#   chat    128 conversations of 4 turns after a shared 1024-token system prompt,
#           messages of 512-1536 tokens, 64-token answers, conversations starting at
#           the probe's rate: 512 requests a probe, about 550k tokens of histories
# SHARED_FROM / CHAT_FROM (req/s and conversations/s) start each search, FROM_<policy>
# (e.g. FROM_pull_fifo=5) one policy's search; GROWTH (default 1.5) is the search's step;
# POLICIES (e.g. "pull cache_aware") replaces the phase's pair, the workload and cache
# setting staying the phase's; PRIME=1 sends each system prompt once before the first
# probe (the harness's --prime), so a search that starts near its bracket does not meet
# cold caches there; SEED; SUFFIX is appended to result names. A dry run on a CPU (checks the script, not the figures):
#   MODEL_DIR=<python -m benchmarks model-dir D --shape cpu-small> DEVICE=cpu NO_CARRY=1
#   NUM_BLOCKS=256 PYTHON=.venv/bin/python BUDGET_S=120 SHARED_FROM=6 CHAT_FROM=1
#   EXTRA_ARGS="--groups 8 --system-len 256 --prompt-min 16 --prompt-max 64 --conversations 8" ...
set -uo pipefail
phase=${1:?give a phase: cache, shared-pull, shared-push, chat-pull, chat-push, shared-load or chat-load}
out=$(mkdir -p "${2:-${OUT:?give OUT_DIR}}" && cd "${2:-$OUT}" && pwd)
budget=${BUDGET_S:-215}
model=${MODEL_DIR:-/tmp/llama31-8b-shape}
device=${DEVICE:-cuda}
die() { echo "run_prefix_affinity.sh: $*" >&2; exit 1; }

case $phase in
  cache)       workload=shared; policies=(pull round_robin); cache=off ;;
  shared-pull) workload=shared; policies=(pull_fifo pull); cache=on ;;
  shared-push) workload=shared; policies=(round_robin cache_aware); cache=on ;;
  chat-pull)   workload=chat; policies=(pull_fifo pull); cache=on ;;
  chat-push)   workload=chat; policies=(round_robin cache_aware); cache=on ;;
  shared-load|chat-load) workload=${phase%-load}; policies=(pull_fifo pull); cache=on
               capacity=${CAPACITY:?give CAPACITY, the capacity of pull_fifo that the loads are fractions of} ;;
  *) die "unknown phase '$phase' (cache, shared-pull, shared-push, chat-pull, chat-push, shared-load, chat-load)" ;;
esac
[ -n "${POLICIES:-}" ] && read -r -a policies <<<"$POLICIES"

if [ -d .carry ] && [ -z "${NO_CARRY:-}" ] && [ -z "${CARRY_SOURCED:-}" ]; then
  source benchmarks/gpu/device-env.sh .carry && export CARRY_SOURCED=1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
command -v redis-server >/dev/null || die "no redis-server on PATH (source device-env.sh with .carry)"
$PY -c "import grpc, redis, torch" 2>/dev/null || die "$PY cannot import grpc, redis and torch (.carry?)"
if [ "$device" = cuda ]; then
  $PY -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || die "no CUDA device visible"
  $PY -c "import flashinfer" 2>/dev/null || die "flashinfer is not importable (.carry unpacked?)"
fi
[ -f "$model/config.json" ] || $PY -m benchmarks model-dir "$model" >/dev/null || die "cannot write $model"

if [ -z "${NUM_BLOCKS:-}" ]; then
  total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0) \
    || die "nvidia-smi failed: give NUM_BLOCKS"
  used_mib=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0)
  [ "$used_mib" -lt 2048 ] || die "GPU 0 already holds ${used_mib} MiB: another job is on it"
  weights_mib=15320   # 8.03e9 bf16 parameters
  NUM_BLOCKS=$(( (total_mib * 9 / 20 - weights_mib - ${RESERVE_MIB:-4096}) / 2 ))
  [ "$NUM_BLOCKS" -gt 4096 ] || die "only $NUM_BLOCKS KV blocks a replica fit in ${total_mib} MiB"
fi
echo "two replicas on GPU 0, $NUM_BLOCKS KV blocks (16 tokens) each"

# The GPU's clock, temperature and power every 5 s while a search runs (OUT/<name>.gpu.csv):
# p99 TBT sits within a few ms of its bound, so a search's outcome can turn on the card's
# speed; the log tells a slower card from the stack (on 2026-12-06 an H100 held 1905-1980
# MHz through two searches in a row: ../results/prefix_h100_chat/NOTES.md).
gpu_log_pid=
gpu_log_start() {
  [ "$device" = cuda ] || return 0
  nvidia-smi -i 0 --query-gpu=timestamp,clocks.sm,temperature.gpu,power.draw,utilization.gpu \
    --format=csv,noheader -l 5 >"$out/$1.gpu.csv" 2>/dev/null &
  gpu_log_pid=$!
}
gpu_log_stop() { [ -n "$gpu_log_pid" ] && kill "$gpu_log_pid" 2>/dev/null; gpu_log_pid=; }

cleanup() {  # stacks run in their own sessions: a run cut by timeout leaves them behind.
  # Only on the device machine, which runs nothing else; a CPU dry run kills nothing.
  [ "$device" = cuda ] || return 0
  pkill -f -- "-m (stack|router|replica_worker)( |$)" 2>/dev/null
  pkill -f -- "redis-server (127[.]0[.]0[.]1:|.*--port)" 2>/dev/null
  sleep 1
}
cleanup

shared=(--workload shared-prefix --groups 128 --questions 6 --system-len 4096 --prompt-dist uniform
        --prompt-min 128 --prompt-max 512)
chat=(--workload multi-turn --conversations 128 --turns 4 --system-len 1024 --prompt-dist uniform
      --prompt-min 512 --prompt-max 1536)
[ "$workload" = shared ] && default_from=${SHARED_FROM:-24} || default_from=${CHAT_FROM:-4}
declare -n shape=$workload
off=(); [ "$cache" = off ] && off=(--replica-arg=--no-prefix-caching)
prime=(); [ -n "${PRIME:-}" ] && prime=(--prime)
# The roofline's card: the one the run is on (--hardware gpu); the CPU dry run has none.
# Result files are named by the card too.
card=cpu; hardware=none
if [ "$device" = cuda ]; then
  hardware=gpu
  card=$($PY -c "from benchmarks.harness.roofline import gpu_card; print(gpu_card())") || card=gpu
fi
common=(--start-stack --replicas 2 --stack-arg=--replica-gpus=0,0 --device "$device" --model "$model"
        --hardware "$hardware" --replica-arg=--load-format --replica-arg=dummy
        --replica-arg=--num-blocks --replica-arg="$NUM_BLOCKS" --replica-arg=--max-num-seqs --replica-arg=256
        --replica-arg=--chunk-size --replica-arg=2048 "${off[@]}" "${shape[@]}" --output-dist fixed
        --output-len 64 --tbt-slo 0.1 --ttft-p99-slo 2 --growth "${GROWTH:-1.5}" --max-probes 5 --rel-tol 0.08
        --seed "${SEED:-1}" --no-progress --summary-dir "$out" "${prime[@]}" ${EXTRA_ARGS:-})

if [ -n "${capacity:-}" ]; then   # one compare run of every policy at each load
  loads=${LOADS:-0.7}
  name=${card}_prefix_${workload}_load${loads// /_}_of${capacity}_cache${cache}${SUFFIX:-}
  gpu_log_start "$name"
  echo "== $name: python -m benchmarks compare --policies ${policies[*]} --capacity $capacity --loads $loads ${common[*]}" >>"$out/$name.log"
  # shellcheck disable=SC2086   # LOADS is a list of fractions
  timeout -s INT -k 30 "$budget" $PY -m benchmarks compare --policies "${policies[@]}" --capacity "$capacity" \
    --loads $loads "${common[@]}" --name "$name" --out-dir "$out/harness/$name" \
    --stack-log-dir "/tmp/stack-logs/$name" >>"$out/$name.log" 2>&1
  echo "== $name: exit $?" >>"$out/$name.log"
  gpu_log_stop
  tail -n 12 "$out/$name.log"
  cleanup
  policies=()
fi
for policy in "${policies[@]}"; do
  name=${card}_prefix_${workload}_${policy}_cache${cache}${SUFFIX:-}
  from_var=FROM_$policy
  from=${!from_var:-$default_from}
  gpu_log_start "$name"
  echo "== $name: python -m benchmarks capacity --policy $policy --initial-rate $from ${common[*]}" >>"$out/$name.log"
  timeout -s INT -k 30 "$budget" $PY -m benchmarks capacity --policy "$policy" --initial-rate "$from" "${common[@]}" \
    --name "$name" --out-dir "$out/harness/$name" --stack-log-dir "/tmp/stack-logs/$name" >>"$out/$name.log" 2>&1
  rc=$?
  gpu_log_stop
  echo "== $name: exit $rc" >>"$out/$name.log"
  grep -E "^  probe|^capacity" "$out/$name.log" | tail -n 8
  if [ ! -f "$out/$name.json" ]; then   # no probe finished: the stack did not serve
    tail -n 40 "$out/$name.log"
    cleanup
    die "$name produced no result (log above; stack logs under /tmp/stack-logs/$name)"
  fi
  cleanup
done
mkdir -p "$out/stack-logs"
for f in /tmp/stack-logs/*/*/*.log /tmp/stack-logs/*/*.log /tmp/stack-logs/*/stack.out /tmp/stack-logs/*/*/stack.out; do
  [ -f "$f" ] && tail -n 60 "$f" >"$out/stack-logs/$(echo "${f#/tmp/stack-logs/}" | tr / _)"
done
exit 0
