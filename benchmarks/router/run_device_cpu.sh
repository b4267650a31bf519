#!/usr/bin/env bash
# The router's CPU benchmarks on the H200 host's 16 cores (no GPU used), from a plain
# copy of the tree and a carry made by prepare-device-cpu-carry.sh:
# CARRY may also be prepare-carry.sh's GPU carry (.carry) for the overhead phase.
#   bash benchmarks/router/run_device_cpu.sh CARRY OUT overhead   # this router beside .baseline's  (RATES="250 500 1000", REPEATS=3 for more,
#                                                                  # VARIANT="name=router args" for this router with other settings too,
#                                                                  # COMPARE="name=TREE ..." for more trees beside .baseline,
#                                                                  # PAIRED=0-6:8-14 both sides at once on those CPU sets, then
#                                                                  # BASELINE=0 and one VARIANT or COMPARE make the second side;
#                                                                  # TOKENS="1 64", NAME=router_overhead_device)
#   bash benchmarks/router/run_device_cpu.sh CARRY OUT profile    # the same sides, one rate each, under py-spy (non-blocking;
#                                                                  # NATIVE=1: C frames too, but py-spy then stops the router at
#                                                                  # every sample and the router sustains a tenth of the rate):
#                                                                  # OUT/profile.tar of p.SIDE.TOKENS.RATE and their top frames
#   bash benchmarks/router/run_device_cpu.sh CARRY OUT peers      # HTTP path beside sglang/vllm-router
#   bash benchmarks/router/run_device_cpu.sh CARRY OUT tier       # sglang-router before mock backends, 64-token
#                                                                  # answers (peers.py's: answered whole, not
#                                                                  # streamed; #16's figure for scale), then the
#                                                                  # router tier (run_router_tier.sh's ladder: RATES,
#                                                                  # ROUTERS, FAILOVER_S as there), one call, one box;
#                                                                  # CARRY from ONLY_SGLANG=1 prepare-device-cpu-carry.sh
#                                                                  # (.carry-tier), so the tree fits beside it
# Each phase stays under the device's 10 minutes a call; JSONs land in OUT.
# Write the tree's commit first (git rev-parse HEAD > COMMIT; ignored, so name it
# in the call's carry): the device copy's git names the commit its session
# started from, and the JSONs would record that one.
set -uo pipefail
carry=${1:-.carry-cpu}; out=${2:-/tmp/out}; phase=${3:-overhead}
mkdir -p "$out"
if [ ! -d "$carry/router" ] && compgen -G "$carry/*.whl" >/dev/null; then
  # A GPU carry (prepare-carry.sh's flat layout), so one call can branch on the card: its
  # router wheels and Redis debs serve the overhead phase (no peers, no wrk).
  flat=$carry; carry=/tmp/quadriga-cpu-carry; mkdir -p "$carry/router" "$carry/debs"
  cp "$flat"/*.whl "$carry/router/"; rm -f "$carry"/router/apache_tvm_ffi-*; cp "$flat"/*.deb "$carry/debs/"
fi
source benchmarks/router/peers-env.sh "$carry"
[ -f COMMIT ] || echo "no COMMIT file: the JSONs will name whatever commit this copy's git answers"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
note="${gpu:-device} host, $(nproc) cores, nothing else running; router, scripted replicas, Redis and the load generator share them"
echo "load before: $(cat /proc/loadavg)"
compare=()
[ "${BASELINE:-1}" = 0 ] || compare=(--compare .baseline)
for c in ${COMPARE:-}; do compare+=(--compare "$c"); done
case "$phase" in
  overhead)
    [ -d .baseline/router ] || { echo "no .baseline/ (git archive of the commit to compare with)"; exit 2; }
    timeout 560 python3 -m benchmarks.router.overhead "${compare[@]}" --rates ${RATES:-500} \
        --output-tokens ${TOKENS:-1 64} --repeats ${REPEATS:-2} --duration 5 ${VARIANT:+--variant "$VARIANT"} \
        ${PAIRED:+--paired "$PAIRED"} --out "$out/${NAME:-router_overhead_device}.json" ;;
  profile)
    [ -d .baseline/router ] || { echo "no .baseline/ (git archive of the commit to compare with)"; exit 2; }
    mkdir -p "$out/profile"
    timeout 560 python3 -m benchmarks.router.overhead "${compare[@]}" --rates ${RATES:-500} \
        --output-tokens 1 64 --duration 5 ${VARIANT:+--variant "$VARIANT"} --profile "$out/profile/p" \
        ${NATIVE:+--native} --profile-hz ${PROFILE_HZ:-200}
    rc=$?
    for f in "$out"/profile/p.*[0-9]; do
      [ -f "$f" ] || continue
      python3 -m benchmarks.router.profile_top "$f" --top 60 > "$f.top.txt"
      python3 -m benchmarks.router.profile_top "$f" --top 60 --thread MainThread > "$f.main.txt"
    done
    tar -C "$out" -cf "$out/profile.tar" profile && rm -rf "$out/profile"
    (exit $rc) ;;
  peers)
    timeout 560 python3 -m benchmarks.router.peers --peers-site "$QUADRIGA_PEERS_SITE" --mock-workers 4 \
        --repeats 3 --duration 5 --profile-dir "$out/profile" --machine-note "$note" \
        --out "$out/router_peers.json" ;;
  tier)
    timeout 90 python3 -m benchmarks.router.peers --peers-site "$QUADRIGA_PEERS_SITE" --only sglang-router \
        --max-tokens 64 --concurrency 64 --repeats 2 --duration 5 --mock-workers 4 --machine-note "$note" \
        --out "$out/router_tier_sglang.json"
    NO_CARRY=1 PYTHON=python3 TIER_TIMEOUT=${TIER_TIMEOUT:-420} bash benchmarks/gpu/run_router_tier.sh - "$out" ;;
  *) echo "unknown phase $phase (overhead | profile | peers | tier)"; exit 2 ;;
esac
rc=$?
echo "load after: $(cat /proc/loadavg)"
exit $rc
