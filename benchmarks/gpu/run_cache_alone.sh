#!/usr/bin/env bash
# #14's "the engine cache alone" figure in ONE device call: pull with affinity on the
# shared-prefix workload, the engine cache off and then on, each a short capacity search
# (run_prefix_affinity.sh's phases `cache` and `shared-pull`, POLICIES=pull), so both
# sides run on one machine in one run. Sized by the GPU's memory: on an H200 64 groups
# and 11,320 KV blocks a replica (the README's H200 prefix rows); on an 80 GB card 48
# groups and the script's own sizing (about 8.6k blocks), the same ratio of system-prompt
# tokens to one replica's cache (about 1.4). Usage on the device, from the repo root:
#   bash benchmarks/gpu/run_cache_alone.sh .carry $OUT/cache_alone
# OFF_FROM / ON_FROM (req/s) start the two searches; each search has at most
# MAX_PROBES (2) probes growing or shrinking by GROWTH (1.15) and BUDGET_S (230) seconds.
# The claim the two make together: cache-on capacity / cache-off capacity is at least
# (cache-on's highest passing rate) / (cache-off's lowest failing rate).
set -uo pipefail
carry=${1:-.carry}; out=${2:?give OUT}
source benchmarks/gpu/device-env.sh "$carry" && export CARRY_SOURCED=1
total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0)
if [ "$total_mib" -gt 100000 ]; then groups=64; export NUM_BLOCKS=${NUM_BLOCKS:-11320}
else groups=48; fi
export PRIME=1 GROWTH=${GROWTH:-1.15} BUDGET_S=${BUDGET_S:-230} POLICIES=pull SUFFIX=_onecall
export EXTRA_ARGS="--groups $groups --max-probes ${MAX_PROBES:-2}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
FROM_pull=${OFF_FROM:-6.5} bash benchmarks/gpu/run_prefix_affinity.sh cache "$out"
FROM_pull=${ON_FROM:-13.5} bash benchmarks/gpu/run_prefix_affinity.sh shared-pull "$out"
