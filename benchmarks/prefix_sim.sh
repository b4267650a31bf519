#!/usr/bin/env bash
# Cache-affine scheduling where every replica has a GPU of its own, on a CPU machine:
# two simulated replicas (python -m stack --simulate: the real worker, scheduler, block
# manager and prefix cache, each step timed by the h200-8b cost model), so no second
# replica's prefill slows a replica's decodes, as it does on one shared GPU
# (benchmarks/results/prefix_h100_chat/). It compares pull with and without its load
# term (pull_balanced: --pull-affinity-balance-abs 8192) and cache_aware on the
# multi-turn chat workload of the H100 runs (48 conversations of 4 turns after a
# 1024-token system prompt, messages of 512-1536 tokens, 64-token answers; 8,642 KV
# blocks a replica, so one replica's cache cannot hold every history and two can).
#
#   bash benchmarks/prefix_sim.sh                        # the committed figures
#   SEEDS=1 RATES=1 bash benchmarks/prefix_sim.sh        # one seed, one load
#   PHASES=loads SEEDS=2 bash benchmarks/prefix_sim.sh   # the compare runs only
#   CONVERSATIONS=128 PHASES=capacity SEEDS=1 POLICIES="pull pull_balanced" bash benchmarks/prefix_sim.sh
#                                                        # more conversations than the caches hold
#   WORKLOAD=shared SHARED_DEVICE=1 PHASES=capacity SEEDS=1 TIME_SCALE=2 \
#     POLICIES="cache_aware round_robin pull" FROM_pull=5 FROM_cache_aware=4 FROM_round_robin=2.2 \
#     GROWTH=1.2 MAX_PROBES=4 bash benchmarks/prefix_sim.sh   # the H200 shared-prefix setup, one modelled GPU
#
# SHARED_DEVICE=1: the two replicas share ONE modelled GPU (--shared-device: while both
# are in a step, each advances at half speed), as the two replicas of the GPU prefix runs
# share one card (benchmarks/gpu/run_prefix_affinity.sh); result names end in _shared_device.
# WORKLOAD=shared: that script's H200 shared-prefix workload (64 groups of a
# 4096-token system prompt, 6 questions of 128-512 tokens, 11,320 KV blocks a replica),
# each search on one stack with the caches primed (--prime), as the H200 searches ran;
# chat (the default) probes each on a fresh stack (--cold-probes, below).
# FROM_<policy> starts that policy's search (default CAP_FROM, 2).
# ASYNC=1: the simulated replicas model async scheduling (--async-scheduling: a step's host
# work overlaps the previous step on the device, as the CUDA engine does by default);
# result names end in _async.
#
# Time is stretched: every modelled step lasts TIME_SCALE (4) times the cost model's
# time, and the SLOs (p99 TBT 0.1 s, p99 TTFT 2 s, p50 scheduling delay 2 s) and pull's
# wait bound (2 s) are stretched with it, so the router, Redis, the simulators' own
# Python and the load generator stay a small share of a 2-core machine. Rates and
# latencies are in stretched time: divide rates by TIME_SCALE, and multiply
# latencies by 1/TIME_SCALE, for the modelled H200's.
#
# Per seed, policies in turn in one sitting: a compare run at each of RATES
# (conversations/s, a fresh stack each, so no run starts with caches another filled),
# then a capacity search of each policy with a fresh stack for every probe (--cold-probes:
# a probe replays the same conversations, which a warm stack would find cached; every
# probe after the first then hit 99-100% and passed). JSONs (with their commands) go to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/prefix_sim}
PY=${PY:-.venv/bin/python}
SEEDS=${SEEDS:-"1 2"}
RATES=${RATES:-"0.5 1 2"}
POLICIES=${POLICIES:-"pull pull_balanced cache_aware"}
TS=${TIME_SCALE:-4}
MODEL=${MODEL:-benchmarks/results/tmp/llama-3.1-8b}
[ -f "$MODEL/config.json" ] || "$PY" -m benchmarks model-dir "$MODEL" --shape llama-3.1-8b >/dev/null
scaled() { "$PY" -c "print($1 * $TS)"; }
WORKLOAD=${WORKLOAD:-chat}
device=(); suffix=""
if [ -n "${SHARED_DEVICE:-}" ]; then
  mkdir -p benchmarks/results/tmp/prefix_sim
  device=(--replica-arg=--shared-device --replica-arg="$PWD/benchmarks/results/tmp/prefix_sim/device")
  suffix=_shared_device
fi
if [ -n "${ASYNC:-}" ]; then
  device+=(--replica-arg=--async-scheduling)
  suffix=${suffix}_async
fi
case $WORKLOAD in
  chat) blocks=8642; probes=(--cold-probes) ;;
  shared) blocks=11320; probes=(--prime) ;;
  *) echo "WORKLOAD is chat or shared, not $WORKLOAD" >&2; exit 2 ;;
esac
stack=(--start-stack --replicas 2 --stack-arg=--simulate --stack-arg=h200-8b --model "$MODEL"
       --hardware none --replica-arg=--time-scale --replica-arg="$TS" "${device[@]}"
       --replica-arg=--num-blocks --replica-arg="$blocks" --replica-arg=--max-num-seqs --replica-arg=256
       --replica-arg=--chunk-size --replica-arg=2048
       --router-arg=--pull-affinity-max-wait --router-arg="$(scaled 2)"
       --tbt-slo "$(scaled 0.1)" --ttft-p99-slo "$(scaled 2)" --sched-delay-slo "$(scaled 2)"
       --output-dist fixed --output-len 64 --no-progress --out-dir benchmarks/results/tmp/prefix_sim)
conversations=${CONVERSATIONS:-48}
chat=(--workload multi-turn --conversations "$conversations" --turns 4 --system-len 1024 --prompt-dist uniform
      --prompt-min 512 --prompt-max 1536)
wl=chat; [ "$conversations" = 48 ] || wl=chat$conversations   # result names
shared=(--workload shared-prefix --groups 64 --questions 6 --system-len 4096 --prompt-dist uniform
        --prompt-min 128 --prompt-max 512)
shape=("${chat[@]}")
if [ "$WORKLOAD" = shared ]; then shape=("${shared[@]}"); wl=shared; fi
wl=$wl$suffix
bench() { flock /tmp/quadriga-bench.lock "$PY" -m benchmarks "$@"; }
done_already() { [ -f "$OUT/$1.json" ]; }   # the script can be resumed
mkdir -p "$OUT"
PHASES=${PHASES:-"loads capacity"}
for seed in $SEEDS; do
  if [[ " $PHASES " == *" loads "* ]]; then for rate in $RATES; do
    name=${wl}_rate${rate}_seed${seed}
    # shellcheck disable=SC2086   # POLICIES is a list
    done_already "$name" || bench compare "${stack[@]}" "${shape[@]}" --policies $POLICIES --rates "$rate" \
      --seed "$seed" --name "$name" --summary-dir "$OUT"
  done; fi
  if [[ " $PHASES " == *" capacity "* ]]; then for policy in $POLICIES; do
    name=${wl}_cap_${policy}_seed${seed}
    from_var=FROM_$policy
    done_already "$name" || bench capacity "${stack[@]}" "${shape[@]}" --policy "$policy" \
      "${probes[@]}" --initial-rate "${!from_var:-${CAP_FROM:-2}}" --growth "${GROWTH:-1.3}" \
      --max-probes "${MAX_PROBES:-6}" --rel-tol 0.06 --seed "$seed" --name "$name" --summary-dir "$OUT"
  done; fi
done
rm -f "$OUT"/*.png
