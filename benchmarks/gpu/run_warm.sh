#!/usr/bin/env bash
# On a fresh device machine: pay the first engine start once, where it is measured,
# before the benchmark that follows. Runs time_first_start.py with stack samples every
# 5 s (OUT/warm/: its stages, the stacks and their summary: where a first start's time
# goes, benchmarks/gpu/NOTES.md; written.txt: the files it wrote outside the tree, on every
# filesystem, by folder), packs the kernel caches it built into OUT
# (pack-caches.sh: copy them into the carry for the next fresh machine), then runs
# the given command. Usage on the device, from the repo root:
#   bash benchmarks/gpu/run_warm.sh .carry $OUT python3 benchmarks/gpu/bench_engine.py --out $OUT/e.json
set -uo pipefail
carry=${1:?give the carry folder}; out=${2:?give OUT}; shift 2
source benchmarks/gpu/device-env.sh "$carry" && export CARRY_SOURCED=1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
mkdir -p "$out/warm"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
marker=$(mktemp /tmp/warm-marker.XXXXXX); sleep 1
start=$(date +%s)
timeout "${WARM_TIMEOUT_S:-330}" python3 benchmarks/gpu/time_first_start.py --out "$out/warm/first_start.json" \
  --stacks "$out/warm/stacks.txt" >"$out/warm/first_start.txt" 2>&1 || echo "the warm-up start failed or ran out of time"
echo "warm-up: $(( $(date +%s) - start )) s"; grep -E "s  " "$out/warm/first_start.txt" | tail -n 12
# What the start wrote outside this tree (caches a fresh machine lacks), on every real
# filesystem (each walked on its own device, pseudo ones left out), summed by folder.
mapfile -t roots < <(findmnt -rn -o TARGET,FSTYPE 2>/dev/null | awk '$2 !~ /^(proc|sysfs|devtmpfs|devpts|cgroup2?|mqueue|debugfs|tracefs|securityfs|pstore|bpf|autofs|configfs|fusectl|hugetlbfs|binfmt_misc|nsfs)$/ {print $1}' | sort -u)
for root in "${roots[@]:-/}"; do
  find "$root" -xdev \( -path "$PWD" -o -path "$out" -o -path /proc -o -path /sys \) -prune \
    -o -type f -newer "$marker" -printf '%s %h\n' 2>/dev/null
done | awk '{split($2, p, "/"); d = "/" p[2] "/" p[3] "/" p[4]; s[d] += $1; n[d]++}
  END {for (d in s) printf "%10.1f MiB %6d files  %s\n", s[d] / 1048576, n[d], d}' | sort -rn >"$out/warm/written.txt"
head -n 12 "$out/warm/written.txt"; rm -f "$marker"
python3 benchmarks/gpu/stack_summary.py "$out/warm/stacks.txt" --top 30 >"$out/warm/stacks_summary.txt" 2>&1
head -n 20 "$out/warm/stacks_summary.txt"
bash benchmarks/gpu/pack-caches.sh "$out" >/dev/null 2>&1
ls "$out"/*cache.tar* 2>/dev/null
if [ $# -gt 0 ]; then "$@"; fi
