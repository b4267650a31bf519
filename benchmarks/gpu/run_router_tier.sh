#!/usr/bin/env bash
# The router tier benchmark (benchmarks/router/tier.py) on the device machine's
# 16 CPU cores, no GPU used: 1, 2 and 4 routers on one Redis before 64 simulated
# replicas (4 processes of 16, cost model h200-8b), open-loop 64-token streams
# from 4 load generator processes, then 4 routers at 70% of what 4 sustained
# with one killed. About 6 minutes. Usage (device tool, carrying .carry from
# prepare-carry.sh, which brings redis-server and the gRPC/Redis packages):
#   bash benchmarks/gpu/run_router_tier.sh .carry $OUT
# RATES="..." overrides the ladder of offered req/s (PER_ROUTER=1: per router, n routers offered
# n times each); FAILOVER_S the failover run's length (15 s), FAILOVER_LOADS its shares of what
# FAILOVER_ROUTERS sustained, one run each (0.7),
# FAILOVER_ROUTERS=0 skips it; ROUTERS="1 4" the router counts (1 2 4); TIER_TIMEOUT the
# benchmark's own limit (530 s); PER_PROCESS simulated replicas a process (8: 8 processes, so
# no simulator process binds near 700 req/s); CLIENTS load generator processes (8).
# A dry run here: NO_CARRY=1 PYTHON=.venv/bin/python SMALL=1 bash benchmarks/gpu/run_router_tier.sh - /tmp/tier
set -uo pipefail
carry=${1:-.carry}; out=$(mkdir -p "${2:-/tmp/out}" && cd "${2:-/tmp/out}" && pwd)
if [ -z "${NO_CARRY:-}" ]; then
  source benchmarks/gpu/device-env.sh "$carry"
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
nproc; $PY --version; command -v redis-server
if [ -n "${SMALL:-}" ]; then
  size=(--routers 1 2 --replicas 8 --per-process 4 --rates 10 20 --rates-per-router --duration 3
        --clients 1 --failover-routers 2 --failover-duration 6 --failover-load 0.7 0.5)
else
  size=(--routers ${ROUTERS:-1 2 4} --replicas 64 --per-process ${PER_PROCESS:-8}
        --rates ${RATES:-50 100 150 200 250 500 1000} ${PER_ROUTER:+--rates-per-router} --duration 8 --clients ${CLIENTS:-8} --failover-routers ${FAILOVER_ROUTERS:-4} --failover-duration ${FAILOVER_S:-15}
        --failover-load ${FAILOVER_LOADS:-0.7})
fi
timeout ${TIER_TIMEOUT:-530} $PY -m benchmarks.router.tier "${size[@]}" --out "$out/router_tier.json" 2>&1 | tail -40
