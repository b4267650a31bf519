#!/usr/bin/env bash
# The CPU cache-affinity searches of prefix_primed_cpu.sh on the 16 CPU cores of a
# device host (no GPU used), where the router, Redis, the load generator and the two
# replicas do not share 2 cores: each replica's engine gets REPLICA_THREADS (2) torch
# threads, the rest of the host the other processes. Policies alternate in one
# sitting, as in prefix_primed_cpu.sh. Usage on the device, from the repo root:
#   bash benchmarks/prefix_device_cpu.sh .carry $OUT/prefix_cpu16
#   WORKLOAD=chat POLICIES="pull cache_aware" bash benchmarks/prefix_device_cpu.sh .carry $OUT/x
# NO_CARRY=1 runs it where the packages are already installed (a dry run here).
set -euo pipefail
carry=${1:-.carry}; out=${2:?give OUT}
if [ -z "${NO_CARRY:-}" ]; then
  source benchmarks/gpu/device-env.sh "$carry"
  export PY=${PY:-python3}
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export STACK_EXTRA="--replica-arg=--threads --replica-arg=${REPLICA_THREADS:-2} ${STACK_EXTRA:-}"
echo "$(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
OUT=$out REPEATS=${REPEATS:-1} SEEDS=${SEEDS:-1} POLICIES=${POLICIES:-"pull round_robin cache_aware"} \
  bash benchmarks/prefix_primed_cpu.sh
