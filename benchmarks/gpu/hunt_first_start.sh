#!/usr/bin/env bash
# On the device: what does a process's first engine start leave behind that makes the
# second one fast (benchmarks/gpu/NOTES.md, "A process's first engine start")? Runs
# time_first_start.py twice and, in between, lists every file the first run wrote or
# changed, on every mounted filesystem, outside this tree and OUT:
#   source benchmarks/gpu/device-env.sh .carry
#   bash benchmarks/gpu/hunt_first_start.sh $OUT/hunt
# Writes OUT/env.txt (the cache settings in force), first.json/.txt, newer_files.tsv
# (bytes, path; largest first), newer_by_folder.txt (the same summed by folder, three
# levels deep), second.json/.txt, OUT/mounts.txt and first_stacks.txt (every thread's
# stack every 5 s of the first run: where its time goes; first_stacks_summary.txt
# counts its frames, benchmarks/gpu/stack_summary.py).
set -uo pipefail
out=$(mkdir -p "${1:?give OUT}" && cd "$1" && pwd)
here=$(pwd)
env | grep -E '^(CUDA|TRITON|TORCH|FLASHINFER|TVM|XDG|HOME|PYTHON|NV|LD_)' | sort >"$out/env.txt"
findmnt -rn -o TARGET,FSTYPE >"$out/mounts.txt" 2>/dev/null || cat /proc/mounts >"$out/mounts.txt"
marker=$(mktemp /tmp/hunt-marker.XXXXXX)
sleep 1   # file times have a one-second grain on some filesystems
python3 benchmarks/gpu/time_first_start.py --out "$out/first.json" --stacks "$out/first_stacks.txt" >"$out/first.txt" 2>&1 \
  || echo "the first run failed (see first.txt)"
# Every real filesystem, each walked on its own device (-xdev), its pseudo ones left out.
mapfile -t roots < <(awk '$2 !~ /^(proc|sysfs|devtmpfs|devpts|cgroup2?|mqueue|debugfs|tracefs|securityfs|pstore|bpf|autofs|configfs|fusectl|hugetlbfs|binfmt_misc|nsfs)$/ {print $1}' \
  <(findmnt -rn -o TARGET,FSTYPE 2>/dev/null || awk '{print $2, $3}' /proc/mounts) | sort -u)
for root in "${roots[@]}"; do
  find "$root" -xdev \( -path "$here" -o -path "$out" -o -path /proc -o -path /sys \) -prune \
    -o -type f -newer "$marker" -printf '%s\t%p\n' 2>/dev/null
done | sort -u | sort -rn >"$out/newer_files.tsv"
python3 - "$out/newer_files.tsv" >"$out/newer_by_folder.txt" <<'PY'
import collections, sys
sizes, counts = collections.Counter(), collections.Counter()
for line in open(sys.argv[1]):
    size, path = line.rstrip("\n").split("\t", 1)
    folder = "/".join(path.split("/")[:4])
    sizes[folder] += int(size)
    counts[folder] += 1
for folder, size in sizes.most_common():
    print(f"{size / 2**20:10.1f} MiB {counts[folder]:7d} files  {folder}")
PY
head -n 25 "$out/newer_by_folder.txt"
python3 benchmarks/gpu/time_first_start.py --out "$out/second.json" >"$out/second.txt" 2>&1 \
  || echo "the second run failed (see second.txt)"
python3 benchmarks/gpu/stack_summary.py "$out/first_stacks.txt" --top 30 >"$out/first_stacks_summary.txt" 2>&1
head -n 25 "$out/first_stacks_summary.txt"
for f in first second; do
  printf '%s: ' "$f"; tail -n 1 "$out/$f.txt"
done
rm -f "$marker"
