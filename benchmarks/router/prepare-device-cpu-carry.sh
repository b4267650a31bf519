#!/usr/bin/env bash
# Fill DIR (default .carry-cpu) for run_device_cpu.sh on the H200 host, within the device's
# 64 MiB carry: that image has Python 3.12 with torch, transformers and numpy, so only the
# router's network packages travel (from prepare-carry.sh, less flashinfer), plus
# httptools/uvloop/py-spy, the peers unpacked, stripped and xz-packed (their wheels are 55 MB),
# and Debian's wrk and redis-server. Also writes .baseline/, the tree of BASE (default: the
# commit before this wave's router redesign) for overhead.py --compare. Run it here, with network:
#   bash benchmarks/router/prepare-device-cpu-carry.sh [DIR] [BASE]
#   ONLY_SGLANG=1 bash benchmarks/router/prepare-device-cpu-carry.sh .carry-tier   # for the tier phase
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=${1:-.carry-cpu}; base=${2:-7684da7}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
bash "$root/benchmarks/gpu/prepare-carry.sh" "$work/gpu" >/dev/null
bash "$root/benchmarks/router/prepare-peers-carry.sh" "$work/peers" >/dev/null
rm -rf "$dir"; mkdir -p "$dir/router" "$dir/debs" "$work/unpacked/site"
cp "$work"/gpu/*.whl "$dir/router/"; rm -f "$dir"/router/apache_tvm_ffi-*
cp "$work"/peers/router/{httptools,uvloop,py_spy}-*.whl "$dir/router/"
cp "$work"/peers/debs/*.deb "$dir/debs/"
for w in "$work"/peers/peers/*.whl; do python3 -m zipfile -e "$w" "$work/unpacked/site"; done
# ONLY_SGLANG=1: the tier phase's carry (sglang-router only), which leaves room for the tree
# under the 64 MiB limit (the whole peers archive does not: 58 MB with a 12 MB tree).
if [ -n "${ONLY_SGLANG:-}" ]; then rm -rf "$work/unpacked/site"/vllm_router*; fi
# The peers' Rust libraries ship unstripped (154 MB; 121 MB stripped): stripped, the carry
# fits, and nothing they run changes.
find "$work/unpacked/site" -name '*_rs.abi3.so' -exec strip --strip-unneeded {} +
tar -C "$work/unpacked" -cf - site | xz -T0 -6 > "$dir/peers.tar.xz"
if git -C "$root" rev-parse --verify -q "$base^{commit}" >/dev/null; then
  rm -rf "$root/.baseline"; mkdir "$root/.baseline"
  git -C "$root" archive "$base" | tar -x -C "$root/.baseline" --exclude='benchmarks/results' --exclude='*.png'
  git -C "$root" rev-parse "$base^{commit}" > "$root/.baseline/COMMIT"
fi
du -sh "$dir" "$root/.baseline" 2>/dev/null
